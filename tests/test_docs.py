"""The docs' figures come from saved results: every `bench/results/<name>` the docs mention
exists, every table in docs/benchmarks.md cites one, and artifacts/README.md's example folder
name is the one `aot build` makes for the shape it names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aot.plan import plan_build
from aot.targets import parse_target
from wan.configs import VideoShape
from wan.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "artifacts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULT = re.compile(r"bench/results/([\w.+-]+)")


def missing_results(text: str) -> list[str]:
    """The `bench/results/<name>` files `text` names that do not exist."""
    return [m for m in RESULT.findall(text) if not (ROOT / "bench" / "results" / m).is_file()]


def tables_without_results(text: str) -> list[str]:
    """The first row of every table that no results file is cited for: neither in the table nor
    in the text between it and the previous table or heading (where its command is given)."""
    uncited, since, table = [], [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            if not RESULT.search("\n".join(since + table)):
                uncited.append(table[0])
            since, table = [], []
        since = [] if line.startswith("#") else [*since, line]
    return uncited


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_named_exists(doc):
    assert missing_results(doc.read_text()) == []


def test_every_benchmark_table_cites_a_results_file():
    assert tables_without_results((ROOT / "docs" / "benchmarks.md").read_text()) == []


def test_the_checks_find_what_they_look_for():
    """Controls: a results file that is not there, a table with no results file before it (the
    previous table's citation does not count), and one cited in its own rows."""
    assert missing_results("`bench/results/memory_table.json` and bench/results/gone.json") == [
        "gone.json"
    ]
    doc = "## A\n`python bench/x.py` (bench/results/x.json)\n\n| a |\n|---|\n| 1 |\n\ntext\n"
    assert tables_without_results(doc) == []
    assert tables_without_results(doc + "\n| b |\n|---|\n| 2 |\n") == ["| b |"]
    assert tables_without_results(doc + "## B\n\n| c |\n|---|\n| 3 |\n") == ["| c |"]
    assert tables_without_results("| d |\n|---|\n| bench/results/x.json |\n") == []


def test_artifacts_readme_example_is_what_a_build_names():
    """The example folder name is `aot build`'s key for the model, shape and target it names
    (planning only: no compile, no TPU; an alias's last number is its device count)."""
    text = (ROOT / "artifacts" / "README.md").read_text()
    (example,) = re.findall(r"e\.g\. `([^`]+)`", text)
    model, res, frames, batch, target = re.match(
        r"([\w.-]+?)_(\d+x\d+)_f(\d+)_b(\d+)_([\w-]+?-\d+)_", example
    ).groups()
    width, height = (int(v) for v in res.split("x"))
    shape = VideoShape(width, height, int(frames), int(batch))
    devices = int(target.rsplit("-", 1)[1])
    plan = plan_build(model, PRESETS[model], shape, parse_target(target), devices)
    assert example == plan.key.folder_name()
