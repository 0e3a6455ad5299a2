"""`runtime serve`: the builds in --artifacts as an HTTP service (runtime.serve.server), loaded once,
compiling nothing."""

from __future__ import annotations

import os
from pathlib import Path

import click

from runtime.builds.artifact import ArtifactError, BuildKey, Manifest
from runtime.builds.loader import (
    Present,
    Request,
    candidate_builds,
    describe_route,
    match_build,
    passed_over,
    route,
    serving_routes,
    verify_signed,
)
from runtime.cli import options as cli_options
from runtime.cli.args import TRUSTED_KEY, CliError
from runtime.generation import step_cache
from runtime.serve import peers
from runtime.serve.http_guards import (
    API_KEYS_ENV,
    MAX_BODY_BYTES,
    HttpLimits,
    check_open,
    load_api_keys,
)
from runtime.serve.job_store import LEASE_S, LOCK_TIMEOUT_S, MAX_ATTEMPTS, JobStore
from runtime.trust import signing
from wan.configs import ModelConfig
from wan.presets import model_spec


@click.command("serve")
@cli_options.ARTIFACTS
@cli_options.WEIGHTS
@cli_options.LORA
@TRUSTED_KEY
@click.option(
    "--build",
    "build_names",
    multiple=True,
    help="Serve only these build folders (repeatable, one per size, frames, CFG and pipeline, text "
    "or image to video; default: of the builds that serve the weights' model on these devices, "
    "the largest batch of each).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to serve on; any but loopback takes API keys (--api-key-file, "
    "$WAN_API_KEYS, --api-key).",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--out-dir",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="The job database and the MP4s; a restart on the same folder resumes its queue.",
)
@click.option(
    "--job-store",
    envvar="WAN_JOB_STORE",
    metavar="URL",
    help="postgresql://USER:PASSWORD@HOST:PORT/DATABASE: keep the jobs in PostgreSQL, shared by "
    "every replica given the same URL and the same --out-dir (a folder they all mount, README: "
    "Scaling out); default: SQLite in --out-dir, one server. $WAN_JOB_STORE is read too (a "
    "password on the command line shows in `ps`).",
)
@click.option(
    "--replica",
    help="This server's name in a fleet (/metrics, the jobs it holds); unique among the running "
    "replicas. Default: HOSTNAME-PID.",
)
@click.option(
    "--lease",
    default=LEASE_S,
    show_default=True,
    type=cli_options.Seconds(1, 86400),
    help="Seconds a claimed job stays this server's unless renewed (every third of it while the "
    "batch runs): a killed replica's jobs go back to the queue this long after it stopped.",
)
@click.option(
    "--max-attempts",
    default=MAX_ATTEMPTS,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Claims of one job (a replica or a server stopped while running it) before it fails "
    "with the reason instead of being queued again.",
)
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--batch-window",
    default=0.5,
    show_default=True,
    type=cli_options.Seconds(0, 3600),
    help="Seconds a request waits for others to share its batch (a full batch runs at once).",
)
@click.option(
    "--drain-timeout",
    default=300.0,
    show_default=True,
    type=cli_options.Seconds(0, 86400),
    help="On SIGTERM: seconds to finish the batch in flight (else it is queued again).",
)
@click.option(
    "--store-timeout",
    default=LOCK_TIMEOUT_S,
    show_default=True,
    type=cli_options.Seconds(0.01, 600),
    help="Seconds a job-store operation waits for a lock another process holds; past it the "
    "store counts as unusable (POST and /healthz 503) and the worker retries.",
)
@click.option(
    "--max-body-bytes",
    default=MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(1024, 1 << 30),
    help="Largest request body, an input_reference image included (413 past it, refused by its "
    "Content-Length before it is read).",
)
@click.option(
    "--max-prompt-chars",
    default=10_000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Longest prompt and negative prompt, in characters (400 past it).",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=cli_options.Seconds(0.1, 3600),
    help="Seconds a connection has to send a request's head (else it is closed).",
)
@click.option(
    "--body-timeout",
    default=30.0,
    show_default=True,
    type=cli_options.Seconds(0.1, 3600),
    help="Seconds a request has to send its body (else 408).",
)
@click.option(
    "--save-frames",
    is_flag=True,
    help="Keep each video's uint8 frames (F, H, W, 3) as .npy beside its MP4 "
    "(GET /v1/videos/ID/content?variant=frames): the video without the codec's loss, for "
    "quality metrics and evaluation tools.",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="Require `Authorization: Bearer KEY` on every /v1/ route (repeatable; 16 to 512 "
    "characters). A key on the command line shows in `ps`: prefer --api-key-file or "
    "$WAN_API_KEYS (comma-separated keys), which are read too. /healthz and /metrics stay open "
    "for probes and scrapers. Without any key the server is open to whoever reaches the port, so "
    "it then serves only on a loopback --host.",
)
@click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="A file of API keys, one a line (blank lines and # comments skipped), as --api-key; "
    "one without a key is refused.",
)
@cli_options.cache_options
@cli_options.PLACEMENT
@cli_options.job_options
# Longer than most: the start in order, each check before the load or the port it protects.
def serve_cmd(
    artifacts, weights, lora_args, build_names, host, port, out_dir, job_store, replica, lease,
    max_attempts, max_queue, batch_window,
    drain_timeout, store_timeout, max_body_bytes, max_prompt_chars, header_timeout, body_timeout,
    save_frames, api_keys, api_key_file, cache, cache_threshold, cache_max_skip, cache_retention,
    mag_ratios, placement, trusted_keys, coordinator, num_processes, process_id, join_timeout,
) -> None:  # fmt: skip
    """Serve the builds in --artifacts over HTTP as OpenAI's Videos API (the `openai` SDK works
    with base_url http://HOST:PORT/v1; a page to try them at http://HOST:PORT/): load once, queue
    the requests, run them in the builds' batches, compile nothing. API keys: --api-key-file,
    $WAN_API_KEYS or --api-key; /healthz, /metrics, the schema and the page stay open. Plain HTTP:
    for TLS put a reverse proxy in front (README).

    A multi-process build (a slice of several hosts): one `runtime serve` per process, the same
    arguments but --process-id; process 0 listens and keeps the jobs (its --port, --out-dir and
    --job-store), the others run each batch with it (runtime.serve.peers)."""
    cli_options.check_job(coordinator, num_processes, process_id)
    if not weights.is_dir():
        raise CliError(
            f"--weights {weights} is not a folder (a diffusers-format folder or a checkpoint)"
        )
    keys = load_api_keys(api_keys, api_key_file, os.environ.get(API_KEYS_ENV))
    loras = cli_options.loras(lora_args, "--lora")
    trusted = signing.load_trusted_keys(trusted_keys)
    config = ModelConfig.from_folder(weights)
    model_name = model_spec(config, weights)
    if config.needs_last_image:
        raise CliError(
            f"{model_name} is first-last-frame (Wan 2.1 FLF2V): every video needs a last image, "
            "which the Videos API (one input_reference) has no part for: use runtime run "
            "--last-image"
        )
    cache_request = step_cache.from_options(
        cache, cache_threshold, cache_max_skip, cache_retention, mag_ratios, False,
        config.num_experts,
    )  # fmt: skip

    def builds(present: Present) -> list[tuple[Path, Manifest]]:
        return _serving_builds(artifacts, config.hash(), model_name, present, build_names)

    from runtime.serve.server import listen  # before jax: a taken port fails in a second

    leader = process_id == 0  # the process that listens and keeps the jobs
    if leader:
        sock = listen(host, port)
        check_open(host, sock.getsockname()[0], keys)  # where it is bound, not what --host says
        # A store it cannot use fails before anything loads.
        store = JobStore(out_dir, store_timeout, job_store, replica, lease, max_attempts)
        requeued = store.recover()
    cli_options.start(
        lambda present: builds(present)[0], coordinator, num_processes, process_id, join_timeout
    )
    import jax

    from runtime.generation.compiles import CompileCounter
    from runtime.generation.pipeline import Pipeline
    from runtime.serve.server import serve
    from runtime.serve.service import Service

    served = builds(Present.of(jax.devices()))
    continuous = [f.name for f, m in served if m.key.option("continuous")]
    if num_processes > 1 and continuous:
        raise CliError(
            f"{continuous[0]} is a continuous build, whose slots a multi-process job does not "
            "step yet: serve a batch build of that shape (aot build without --continuous)"
        )
    for folder, manifest in served:  # every build before any loads
        verify_signed(folder, manifest, trusted)
    # Before any weight loads: every build served takes the cache (its ratios read once).
    for _, manifest in served if cache_request else ():
        cache_request = step_cache.resolve(
            manifest.key, cache_request, config.num_experts, model_name, artifacts
        )
    placed: dict = {}
    pipelines = {
        folder.name: Pipeline.from_build(
            folder, manifest, weights, config, loras, (), placed, trusted, placement
        )
        for folder, manifest in served
    }
    counter = CompileCounter()
    if not leader:
        peers.follow(peers.JobChannel(process_id, num_processes, peers.exit_now), pipelines,
                     cache_request)  # fmt: skip
        return
    service = Service(
        pipelines, store, max_queue, batch_window, lambda: counter.count, save_frames,
        cache_request,
    )  # fmt: skip
    if num_processes > 1:
        service.peers = peers.JobChannel(process_id, num_processes, service.lose_job)
    if requeued:
        click.echo(f"{requeued} video(s) queued from the last run", err=True)
    limits = HttpLimits(max_body_bytes, max_prompt_chars, header_timeout, body_timeout)
    try:
        serve(service, sock, drain_timeout, limits, lambda line: click.echo(line, err=True), keys)
    finally:
        if service.peers:
            service.peers.close()


def _serving_builds(
    artifacts: Path, model_hash: str, model_name: str, present: Present, names: tuple[str, ...]
) -> list[tuple[Path, Manifest]]:
    """The builds to serve, one per route (runtime.builds.loader.serving_routes, which the server routes
    by): those named, two of one route refused; else, of the builds of the weights' model that
    fit `present` devices, each route's continuous build, else its largest batch."""
    manifests = {f.name: m for f, m in candidate_builds(artifacts) if isinstance(m, Manifest)}
    if names:
        named = {n: manifests[n].key for n in names if n in manifests}
        _one_per_route(named)
        return [
            match_build(
                artifacts,
                Request(named[n].shape if n in named else None, model_hash, serving=True),
                model_name,
                present,
                n,
            )
            for n in dict.fromkeys(names)
        ]
    fits = {
        name: m.key
        for name, m in manifests.items()
        if passed_over(m, Request(m.key.shape, model_hash, serving=True), present) is None
    }
    if not fits:
        raise ArtifactError(
            f"no build in {artifacts} serves the model of these weights on this host: build one "
            f"with `aot build --model {model_name} ... --out {artifacts}` (`runtime run` with the "
            "same shape says why each build is passed over)"
        )
    return [
        match_build(
            artifacts,
            Request(fits[name].shape, model_hash, serving=True),
            model_name,
            present,
            name,
        )
        for name in sorted(serving_routes(fits).values())
    ]


def _one_per_route(named: dict[str, BuildKey]) -> None:
    """Builds named with --build serve different routes: a request picks its build by size,
    frames, CFG and whether it gives an image only, so a second build of a route would be loaded
    and never used."""
    chosen = serving_routes(named)
    for name, key in named.items():
        kept = chosen[route(key)]
        if name != kept:
            raise ArtifactError(
                f"--build {name} and --build {kept} both serve {describe_route(route(key))} (a "
                "request picks its build by size, frames, CFG and whether it gives an image only):"
                f" name one of them, e.g. {kept} (batch {named[kept].batch})"
            )
