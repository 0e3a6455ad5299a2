"""The docs' figures come from saved results: every `bench/results/<name>` the docs mention
exists, every table in docs/benchmarks.md cites one, and artifacts/README.md's example folder
name is the one `aot build` makes for the shape it names. Every dotted name of the project's
packages the docs mention (`runtime.builds.loader.match_build`) is a real object."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from aot.building.plan import plan_build
from aot.targets import parse_target
from wan.configs import VideoShape
from wan.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "artifacts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULT = re.compile(r"bench/results/([\w.+-]+)")
# A dotted name in one of the project's packages; a trailing * names every attribute with that
# prefix (`runtime.builds.artifact.MAX_*`).
DOTTED = re.compile(r"\b((?:wan|aot|runtime)(?:\.[A-Za-z_]\w*)+)(\*?)")


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


def unresolved_names(text: str) -> list[str]:
    """The dotted names in `text` that are no module, attribute or dataclass field."""
    return sorted({name + star for name, star in DOTTED.findall(text) if not _resolves(name, star)})


def _resolves(name: str, star: str) -> bool:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):  # the longest importable module first
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for index, attr in enumerate(parts[split:], split + 1):
            last = index == len(parts)
            if last and star:
                return any(a.startswith(attr) for a in dir(found))
            if hasattr(found, attr):
                found = getattr(found, attr)
            elif last and dataclasses.is_dataclass(found):
                return attr in {f.name for f in dataclasses.fields(found)}
            else:
                return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_is_real(doc):
    assert unresolved_names(doc.read_text()) == []


def test_the_name_check_finds_what_it_looks_for():
    """Controls: a moved function, a module that is not there, a field, a prefix."""
    text = (
        "`runtime.builds.loader.match_build`, `runtime.cli._serving_builds`, `wan.vae_encoder`, "
        "`runtime.builds.artifact.BuildKey.options`, `runtime.builds.artifact.MAX_*`, `aot.building.plan.NO_*`"
    )
    assert unresolved_names(text) == [
        "aot.building.plan.NO_*",
        "runtime.cli._serving_builds",
        "wan.vae_encoder",
    ]


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
