"""Several models served from one GPU pool: the elastic pool under real traffic, and warm restarts.

    python3 benchmarks/bench_multimodel.py --backend cuda           # the GPU run, about 6 minutes
    python3 benchmarks/bench_multimodel.py --backend cpu --quick    # tiny models on the CPU: a smoke run

Three ``kvpool serve`` processes of three geometries (random weights with
the published shapes of Llama-3.2-1B, head_dim 64; Qwen2.5-1.5B, head_dim
128; Gemma-2-2B, head_dim 256 with its sliding window and soft caps; bf16 on
the GPU; tiny models of the same architectures on the CPU) run against three
configurations of the same total KV memory (``--pool-bytes``):

* **elastic**: one kvpoold, one pool for all three models (on the GPU the VMM
  pool: chunks move between the models' layout classes);
* **static**: three kvpoolds, one per model, each with a third of the memory
  (a static split);
* **elastic+host**: the elastic pool with a host tier (``--host-bytes``,
  preemption by swap, evicted prefixes demoted).

Each configuration serves the same traces, prompts of random token ids
behind a few system prompts per model, ShareGPT-like lengths (log-normal with
the means the vLLM paper reports, bench_memory.py; scaled down on the CPU):

1. **bursts**: each model in turn gets a burst of requests while the others
   are idle.  A burst is sized so that its KV, all requests at their last
   token, fills ``--burst-fill`` of the whole pool: about twice a third.
   ``kvpoolctl stats --json`` is recorded before each burst and at the end.
2. **steady**: the three models at once, Poisson arrivals at rates that keep
   ``--steady-load`` of a third of the pool busy per model.  At ``--crash-at``
   a long prompt (``--long-prompt`` tokens) goes to the ``--crash-model``
   server (cold), which is SIGKILLed a second after answering it and started
   again: the daemon reclaims its sequences, the prefixes it computed stay in
   the pool, and the long prompt goes to its successor (warm).
3. **redeploy** (elastic only): the same steady mix, with a rolling redeploy
   of that server (SIGTERM, wait for it to finish its requests, start).

Per model and pattern: TTFT and TPOT p50 / p99, output tokens/s, preemptions
(the servers' counters), prefix-hit tokens (the responses' cached tokens),
and the memory that moved: chunks taken and released by the model's layout
class with the daemon's time mapping and unmapping them (``kvpoolctl stats``:
``taken_bytes``, ``released_bytes``, ``commit_seconds``, ``release_seconds``;
``freed_bytes`` / ``free_seconds``: given back to the GPU).  A request sent
while its server is down is retried until the server is back (its TTFT
counts from its arrival); one whose stream breaks is counted as interrupted.

Prints tables and the targets, writes JSON and a PNG (TTFT over time per
model, elastic against static, the crash marked; KV memory per model) to
benchmarks/results/multimodel_<backend>_<time>.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, print_table, write_json  # noqa: E402
from bench_serve import StreamError, read_token_events  # noqa: E402
from _multimodel_fleet import DaemonProc, Fleet, Sampler, ServeProc, class_figures, growth  # noqa: E402
from _multimodel_models import MODELS, Request, TraceMaker, build_model_dir, shape_of  # noqa: E402

from kvpoold.config import parse_bytes  # noqa: E402

ORDER = ("llama", "qwen", "gemma")
CONFIGS = ("elastic", "static", "elastic+host")
MiB = 1 << 20
PROBE_TOKENS = 4  # output tokens of the long-prompt probes: their TTFT is what counts


# -- options ----------------------------------------------------------------------------------------
#: (backend, --quick) -> the defaults of the options left unset
DEFAULTS = {
    ("cuda", False): dict(chunk_bytes="2MiB", max_num_seqs=128, max_num_batched_tokens=2048, burst_period=7.0,
                          steady_seconds=25.0, redeploy_seconds=20.0, request_seconds=4.0, long_prompt=8192),
    ("cuda", True): dict(chunk_bytes="2MiB", max_num_seqs=128, max_num_batched_tokens=2048, burst_period=5.0,
                         steady_seconds=15.0, redeploy_seconds=15.0, request_seconds=4.0, long_prompt=2048),
    ("cpu", False): dict(chunk_bytes="64KiB", max_num_seqs=32, max_num_batched_tokens=256, burst_period=8.0,
                         steady_seconds=40.0, redeploy_seconds=30.0, request_seconds=6.0, long_prompt=256),
    ("cpu", True): dict(chunk_bytes="64KiB", max_num_seqs=16, max_num_batched_tokens=256, burst_period=6.0,
                        steady_seconds=24.0, redeploy_seconds=20.0, request_seconds=6.0, long_prompt=128),
}

def defaults_help(name: str, what: str = "") -> str:
    """``what``, then the option's default per backend and with ``--quick`` (``DEFAULTS``)."""
    d = {key: DEFAULTS[key][name] for key in DEFAULTS}
    text = "; ".join(f"{d[b, False]} on {b}" + (f" ({d[b, True]} with --quick)" if d[b, True] != d[b, False] else "")
                     for b in ("cuda", "cpu"))
    return f"{what} (default {text})" if what else f"default {text}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("cpu", "cuda"), help="where the daemons and servers run (required)")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="run nothing: print the tables and targets of a stored run and draw its picture again")
    p.add_argument("--quick", action="store_true", help="shorter traces and a shorter long prompt")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)}")
    p.add_argument("--pool-bytes", default=None,
                   help="total KV memory of every configuration (default: sized from the models, see the plan)")
    p.add_argument("--host-bytes", default=None, help="the host tier of elastic+host (default: the pool's size)")
    p.add_argument("--chunk-bytes", default=None, help=defaults_help("chunk_bytes", "on cuda: the VMM granularity"))
    p.add_argument("--release-after-seconds", type=float, default=2.0,
                   help="the daemons' release_after_seconds: an empty slab goes back after this long")
    p.add_argument("--grace-seconds", type=float, default=None, help="the daemons' grace_seconds (default: theirs)")
    p.add_argument("--max-num-seqs", type=int, default=None, help=defaults_help("max_num_seqs", "per server"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help=defaults_help("max_num_batched_tokens"))
    p.add_argument("--burst-fill", type=float, default=0.75,
                   help="share of the whole pool one burst's KV fills (all requests at their last token)")
    p.add_argument("--burst-period", type=float, default=None,
                   help=defaults_help("burst_period", "seconds between the starts of two bursts"))
    p.add_argument("--burst-window", type=float, default=1.0, help="seconds over which a burst's requests arrive")
    p.add_argument("--steady-seconds", type=float, default=None, help=defaults_help("steady_seconds"))
    p.add_argument("--steady-load", type=float, default=0.4,
                   help="share of a third of the pool each model's steady traffic keeps busy")
    p.add_argument("--request-seconds", type=float, default=None,
                   help=defaults_help("request_seconds", "assumed mean request duration, for the steady rates"))
    p.add_argument("--crash-model", default="qwen", choices=ORDER)
    p.add_argument("--crash-at", type=float, default=0.2,
                   help="when in the steady trace (share of it) the long prompt goes to --crash-model; the "
                        "SIGKILL follows a second after its answer")
    p.add_argument("--long-prompt", type=int, default=None, help=defaults_help("long_prompt", "tokens"))
    p.add_argument("--redeploy-seconds", type=float, default=None,
                   help=defaults_help("redeploy_seconds", "0: no rolling-redeploy phase"))
    p.add_argument("--sample-every", type=float, default=0.5, help="seconds between reads of the daemons' stats")
    p.add_argument("--model-dirs", default=None, help="a folder with llama/, qwen/, gemma/ built by an earlier run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.report:
        return args
    if args.backend is None:
        p.error("--backend is required (cpu or cuda)")
    gpu = args.backend == "cuda"
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    args.device = "cuda" if gpu else "cpu"
    args.dtype = "bfloat16" if gpu else "float32"
    for name, value in DEFAULTS[args.backend, args.quick].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# -- the plan: sizes and rates from the models and the pool -------------------------------------------
@dataclass
class Plan:
    pool_bytes: int
    third_bytes: int  # each static daemon's pool
    host_bytes: int
    chunk_bytes: int
    burst_counts: dict[str, int]
    burst_kv_bytes: dict[str, int]  # of each burst, all its requests at their last token
    steady_rates: dict[str, float]  # requests per second
    long_prompt: int
    max_model_len: dict[str, int]
    mean_prompt: float  # over the traces, after clipping
    mean_output: float


def make_maker(args, shapes, seed_offset: int = 0) -> TraceMaker:
    """The traces' requests: ShareGPT-like on the GPU, a tenth of those lengths on the CPU."""
    seed = args.seed + seed_offset
    if args.backend == "cuda":
        return TraceMaker(shapes, seed=seed)
    return TraceMaker(shapes, seed=seed, scale=0.1, max_prompt=200, max_output=64, system_lens=(32, 48, 64))


def make_plan(args, shapes, maker: TraceMaker) -> Plan:
    """Size the pool, the bursts and the steady rates (see ``--help``)."""
    chunk = parse_bytes(args.chunk_bytes)
    n = args.max_num_seqs
    full = {k: maker.kv_bytes([maker.request(k, 0.0, "plan") for _ in range(n)]) for k in ORDER}
    long_bytes = args.long_prompt * shapes[args.crash_model].token_bytes
    # the smallest model's full batch fills --burst-fill of the pool; a third holds the long prompt four
    # times (besides it, the model's steady traffic and what that traffic caches)
    auto = max(min(full.values()) / args.burst_fill, 12 * long_bytes)
    pool = parse_bytes(args.pool_bytes) if args.pool_bytes else -(-int(auto) // chunk) * chunk
    third = pool // 3 // chunk * chunk
    counts, burst_bytes = {}, {}
    for k in ORDER:
        per_request = full[k] / n
        counts[k] = max(1, min(n, int(args.burst_fill * pool / per_request)))
        burst_bytes[k] = int(per_request * counts[k])
    sample = {k: [maker.request(k, 0.0, "plan") for _ in range(200)] for k in ORDER}
    rates = {k: round(args.steady_load * third / (maker.kv_bytes(sample[k]) / 200) / args.request_seconds, 2)
             for k in ORDER}
    every = [r for reqs in sample.values() for r in reqs]
    mean_prompt = float(np.mean([len(r.prompt) for r in every]))
    mean_output = float(np.mean([r.max_tokens for r in every]))
    longest = maker.max_prompt + max(maker.system_lens) + maker.max_output + 16
    max_len = {k: min(shapes[k].max_len, max(longest, args.long_prompt + PROBE_TOKENS + 16) if k == args.crash_model
                      else longest) for k in ORDER}
    if max_len[args.crash_model] < args.long_prompt + PROBE_TOKENS:
        raise SystemExit(f"--long-prompt {args.long_prompt} does not fit {args.crash_model} "
                         f"(at most {shapes[args.crash_model].max_len} positions)")
    host = parse_bytes(args.host_bytes) if args.host_bytes else pool
    return Plan(pool, third, host, chunk, counts, burst_bytes, rates, args.long_prompt, max_len, mean_prompt,
                mean_output)


# -- the fleets --------------------------------------------------------------------------------------
def daemon_args(args, plan: Plan, pool_bytes: int, host: bool) -> list[str]:
    out = ["--backend", args.backend, "--pool-bytes", str(pool_bytes), "--chunk-bytes", str(plan.chunk_bytes),
           "--release-after-seconds", str(args.release_after_seconds), "--log-level", "warning"]
    if args.backend == "cuda":
        out += ["--cuda-memory", "vmm"]
    if args.grace_seconds is not None:
        out += ["--grace-seconds", str(args.grace_seconds)]
    if host:
        out += ["--host-bytes", str(plan.host_bytes)]
    return out


def make_fleet(config: str, args, plan: Plan, model_dirs: dict[str, str], workdir: str) -> Fleet:
    if config == "static":
        daemons = {f"pool-{k}": DaemonProc(f"pool-{k}", workdir, daemon_args(args, plan, plan.third_bytes, False))
                   for k in ORDER}
        home = {k: daemons[f"pool-{k}"] for k in ORDER}
    else:
        daemons = {"pool": DaemonProc("pool", workdir, daemon_args(args, plan, plan.pool_bytes,
                                                                   config == "elastic+host"))}
        home = dict.fromkeys(ORDER, daemons["pool"])
    servers = {k: ServeProc(k, model_dirs[k], home[k], server_options(args, plan, k), workdir) for k in ORDER}
    return Fleet(daemons, servers)


def server_options(args, plan: Plan, key: str) -> list[str]:
    return ["--device", args.device, "--block-size", "16", "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(plan.max_model_len[key])]


# -- sending requests --------------------------------------------------------------------------------
RETRY_SECONDS = 600  # a request waits this long for its server to come back


class Driver:
    """Sends a trace's requests at their arrival times, each to its model's server.

    A request is retried while its server is down (refused, or cut before its first token); its TTFT
    counts from its arrival.  Each model has a gate: while a restart closes it, that model's requests wait
    (the probes of the restarted server go first, as a router would send its readiness checks).
    """

    def __init__(self, client, fleet: Fleet, t0: float) -> None:
        self.client, self.fleet, self.t0 = client, fleet, t0
        self.gates = {k: asyncio.Event() for k in fleet.servers}
        for gate in self.gates.values():
            gate.set()

    async def send(self, req: Request, *, gated: bool = True) -> dict:
        """One streaming completion at its arrival time (``gated``: waits while the model's gate is closed)."""
        import httpx

        await sleep_until(self.t0 + req.arrival)
        arrived = time.perf_counter()
        url = self.fleet.servers[req.model].url
        body = {"model": req.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        attempts, status, stamps, usage = 0, "ok", [], None
        while True:
            if gated:
                await self.gates[req.model].wait()
            stamps, usage = [], None
            try:
                async with self.client.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        status = f"http {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                        break
                    usage = await read_token_events(r, stamps)
                break
            except StreamError as exc:  # the server failed the request mid-stream: it counts as failed
                status = f"error: {str(exc)[:200]}"
                break
            except httpx.HTTPError as exc:  # refused (the server is down) or cut (it was killed)
                if stamps:
                    status = "interrupted"
                    break
                if time.perf_counter() - arrived > RETRY_SECONDS:
                    status = f"unavailable: {exc!r}"
                    break
                attempts += 1
                await asyncio.sleep(0.1)
        return {"model": req.model, "tag": req.tag, "arrival": req.arrival, "prompt_tokens": len(req.prompt),
                "ttft": stamps[0] - arrived if stamps else None,
                "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if status == "ok" and len(stamps) > 1 else None,
                "tokens": len(stamps), "status": status, "attempts": attempts, "end": time.perf_counter() - self.t0,
                "cached": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)}

    async def probe(self, key: str, prompt: list[int], tag: str) -> dict:
        """A request of a few tokens, now, past the model's gate."""
        req = Request(key, time.perf_counter() - self.t0, prompt, PROBE_TOKENS, tag=tag)
        return await self.send(req, gated=False)


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.perf_counter()))


def class_now(fleet: Fleet, key: str, shape) -> dict:
    st = fleet.daemon_of(key).stats()
    for c in st.classes:
        if c.geometry.split(" [")[0] == shape.geometry:
            return class_figures(c)
    return {}


def wait_gone(daemon: DaemonProc, pid: int, since: float, timeout: float = 300) -> float | None:
    """Seconds from ``since`` until the daemon has dropped the session of process ``pid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid not in daemon.client_pids():
            return time.perf_counter() - since
        time.sleep(0.05)
    return None


# -- events during a trace -----------------------------------------------------------------------------
def snapshot_event(fleet: Fleet, at: float, label: str):
    async def run(drv: Driver):
        await sleep_until(drv.t0 + at)
        stats = await asyncio.to_thread(lambda: {n: d.ctl_stats() for n, d in fleet.daemons.items()})
        return {"event": "snapshot", "label": label, "t": time.perf_counter() - drv.t0, "kvpoolctl_stats": stats}
    return run


def restart_event(fleet: Fleet, key: str, shape, prompt: list[int], sig: int, short: list[int], *, at: float,
                  cold_at: float | None = None):
    """Stop the server (SIGKILL: a crash; SIGTERM: a rolling redeploy) at ``at``, start it again, probe it.

    With ``cold_at``, the long prompt goes to the server first (at that time, once no request waits
    there) and the stop comes ``at`` seconds after its answer: the server being stopped is the one that
    computed it, and its own traffic has had little time to evict it.
    After the restart the model's gate stays closed for two probes: a short prompt (the new process
    compiles its prefill kernels on its first one) and the long prompt again (warm); the requests that
    arrived meanwhile follow once it is answered (so the class's figures around it are the probe's own).
    """
    async def run(drv: Driver):
        s, gate, cold = fleet.servers[key], drv.gates[key], None
        if cold_at is not None:
            await sleep_until(drv.t0 + cold_at)
            await asyncio.to_thread(s.wait_no_queue, RETRY_SECONDS)
            cold = await drv.probe(key, prompt, "long-cold")
        await sleep_until((time.perf_counter() if cold_at is not None else drv.t0) + at)
        pid, before = s.pid, await asyncio.to_thread(class_now, fleet, key, shape)
        gate.clear()
        killed = time.perf_counter()
        await asyncio.to_thread(s.stop, sig, RETRY_SECONDS)
        exited = time.perf_counter()
        reclaimed = asyncio.create_task(asyncio.to_thread(wait_gone, s.daemon, pid, killed))
        s.launch()
        await asyncio.to_thread(s.wait_ready)
        ready = time.perf_counter()
        first = await drv.probe(key, short, "first-after-restart")
        mid = await asyncio.to_thread(class_now, fleet, key, shape)
        warm = await drv.probe(key, prompt, "long-warm")
        after = await asyncio.to_thread(class_now, fleet, key, shape)
        gate.set()
        return {"event": "restart", "signal": signal.Signals(sig).name, "model": key, "cold": cold,
                "t_kill": killed - drv.t0, "t_exit": exited - drv.t0, "t_ready": ready - drv.t0,
                "restart_seconds": ready - killed, "reclaimed_seconds": await reclaimed,
                "class_before": before, "first_request": first, "warm": warm,
                "warm_prefix_hit_tokens": after.get("prefix_hit_tokens", 0) - mid.get("prefix_hit_tokens", 0),
                "warm_promoted_blocks": after.get("promoted_blocks", 0) - mid.get("promoted_blocks", 0)}
    return run


async def drive(fleet: Fleet, reqs: list[Request], events: list, t0: float) -> tuple[list[dict], list[dict]]:
    import httpx

    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        drv = Driver(client, fleet, t0)
        out = await asyncio.gather(*[drv.send(r) for r in reqs], *[e(drv) for e in events])
    return list(out[:len(reqs)]), [e for e in out[len(reqs):] if e is not None]


# -- the patterns ---------------------------------------------------------------------------------------
@dataclass
class Pattern:
    name: str
    reqs: list[Request]
    events: list
    bursts: list[tuple[str, float]] | None = None  # (model, start) of each burst


def bursts_pattern(args, plan: Plan, maker: TraceMaker, fleet: Fleet) -> Pattern:
    reqs, events, starts = [], [], []
    for i, key in enumerate(ORDER):
        start = 0.2 + i * args.burst_period
        starts.append((key, start))
        reqs += maker.burst(key, plan.burst_counts[key], start, args.burst_window)
        events.append(snapshot_event(fleet, start - 0.1, f"before the burst of {key}"))
    events.append(snapshot_event(fleet, 0.2 + len(ORDER) * args.burst_period, "after the bursts' period"))
    return Pattern("bursts", reqs, events, starts)


def steady_reqs(plan: Plan, maker: TraceMaker, seconds: float) -> list[Request]:
    reqs = [r for k in ORDER for r in maker.poisson(k, plan.steady_rates[k], 0.0, seconds, "steady")]
    return sorted(reqs, key=lambda r: r.arrival)


def steady_pattern(args, plan, maker, fleet, shapes, long_prompt, short) -> Pattern:
    d, key = args.steady_seconds, args.crash_model
    events = [snapshot_event(fleet, args.crash_at * d - 0.3, "before the long prompt"),
              restart_event(fleet, key, shapes[key], long_prompt, signal.SIGKILL, short, at=1.0,
                            cold_at=args.crash_at * d)]
    return Pattern("steady", steady_reqs(plan, maker, d), events)


def redeploy_pattern(args, plan, maker, fleet, shapes, long_prompt, short) -> Pattern:
    d, key = args.redeploy_seconds, args.crash_model
    events = [restart_event(fleet, key, shapes[key], long_prompt, signal.SIGTERM, short, at=1.0,
                            cold_at=args.crash_at * d)]
    return Pattern("redeploy", steady_reqs(plan, maker, d), events)


# -- figures --------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def model_figures(results: list[dict], key: str, duration: float, sampler: Sampler, window: tuple[float, float],
                  span: float, chunk_bytes: int) -> dict:
    """One model's figures over a pattern (``window``: its sampler times; ``span``: its arrivals' seconds)."""
    mine = [r for r in results if r["model"] == key]
    ttft = [r["ttft"] * 1e3 for r in mine if r["ttft"] is not None]
    tpot = [r["tpot"] * 1e3 for r in mine if r["tpot"] is not None]

    def grow(section: str, figure: str) -> float:
        samples = sampler.server_samples if section == "servers" else sampler.samples
        return growth(samples, section, key, figure, *window)

    return {
        "requests": len(mine), "ok": sum(r["status"] == "ok" for r in mine),
        "interrupted": sum(r["status"] == "interrupted" for r in mine),
        "failed": sum(r["status"] not in ("ok", "interrupted") for r in mine),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "output_tok_per_s": sum(r["tokens"] for r in mine) / duration,
        # tokens generated while requests arrived (the server's counter): the steady state, without the drain
        "arrivals_output_tok_per_s": growth(sampler.server_samples, "servers", key, "generation_tokens",
                                            window[0], window[0] + span) / span,
        "preemptions": grow("servers", "preemptions"), "swaps": grow("servers", "swaps"),
        "prefix_hit_tokens": sum(r["cached"] for r in mine),
        "chunks_taken": grow("classes", "taken_bytes") / chunk_bytes,
        "chunks_released": grow("classes", "released_bytes") / chunk_bytes,
        "commit_ms": 1e3 * grow("classes", "commit_seconds"), "release_ms": 1e3 * grow("classes", "release_seconds"),
    }


def device_figures(samples: list[dict], daemons, window) -> dict:
    return {"freed_bytes": sum(growth(samples, "devices", n, "freed_bytes", *window) for n in daemons),
            "free_ms": 1e3 * sum(growth(samples, "devices", n, "free_seconds", *window) for n in daemons)}


def arrived_ttft_ms(results: list[dict], key: str, lo: float, hi: float) -> list[float]:
    """TTFT of ``key``'s requests that arrived in ``[lo, hi)``."""
    return [r["ttft"] * 1e3 for r in results if r["model"] == key and r["ttft"] is not None and lo <= r["arrival"] < hi]


def during_crash(results: list[dict], restart: dict, others: list[str]) -> dict:
    """The other models' p99 TTFT while the server was down against the same length of time before."""
    t_kill, t_ready = restart["t_kill"], restart["t_ready"]
    span = t_ready - t_kill
    out = {}
    for key in others:
        before = arrived_ttft_ms(results, key, max(0.0, t_kill - span), t_kill)
        during = arrived_ttft_ms(results, key, t_kill, t_ready)
        p_before, p_during = pct(before, 99), pct(during, 99)
        out[key] = {"requests_before": len(before), "requests_during": len(during), "p99_before_ms": p_before,
                    "p99_during_ms": p_during,
                    "ratio": p_during / p_before if p_before and p_during is not None else None}
    return out


def memory_moves(samples: list[dict], pattern: Pattern, offset: float, period: float, chunk_bytes: int) -> list[dict]:
    """During each burst: what the hot model took, and what each idle model held and gave back."""
    out = []
    for key, start in pattern.bursts:
        lo, hi = offset + start, offset + start + period
        during = [s for s in samples if lo <= s["t"] <= hi]
        row = {"hot": key, "models": {}}
        for k in ORDER:
            held = [s["classes"][k]["mapped_bytes"] for s in during if k in s["classes"]]
            row["models"][k] = {
                "mapped_at_start_mib": held[0] / MiB if held else None,
                "mapped_min_mib": min(held) / MiB if held else None, "mapped_max_mib": max(held) / MiB if held else None,
                "chunks_taken": growth(samples, "classes", k, "taken_bytes", lo, hi) / chunk_bytes,
                "chunks_released": growth(samples, "classes", k, "released_bytes", lo, hi) / chunk_bytes,
            }
        out.append(row)
    return out


# -- one configuration ------------------------------------------------------------------------------------
def warm_up(fleet: Fleet, maker: TraceMaker, args) -> None:
    """Requests that take every server through each kind of step before the traces, so that no kernel
    compiles during them (CUDA kernels compile in each new process, Numba's on a first run): a prompt
    longer than a step (chunked prefill behind its own first chunk), the same prompt again (a prefix
    hit), then a batch of short ones."""
    long = {k: maker.long_prompt(k, args.max_num_batched_tokens + 100) for k in ORDER}
    for wave in (0, 1):
        reqs = [Request(k, 0.0, long[k], 4, tag="warm-up") for k in ORDER]
        if wave:
            reqs += [maker.request(k, 0.0, "warm-up") for k in ORDER for _ in range(8)]
        for r in reqs:
            r.max_tokens = min(r.max_tokens, 8)
        asyncio.run(drive(fleet, reqs, [], time.perf_counter()))


def run_config(config: str, args, plan: Plan, shapes, model_dirs, workdir: str) -> dict:
    print(f"\n== {config}: starting {'three daemons' if config == 'static' else 'one daemon'} and three servers",
          flush=True)
    workdir = str(Path(workdir) / config)  # each configuration's daemon and server logs
    Path(workdir).mkdir()
    fleet = make_fleet(config, args, plan, model_dirs, workdir)
    maker = make_maker(args, shapes)  # the same traces for every configuration
    long_prompt = maker.long_prompt(args.crash_model, plan.long_prompt)
    short = maker.long_prompt(args.crash_model, 32)
    out = {"config": config, "patterns": {}, "restarts": [], "snapshots": []}
    try:
        fleet.start()
        out["eager_fallback"] = fleet.eager_fallback
        sampler = Sampler(fleet, {k: s.geometry for k, s in shapes.items()}, args.sample_every)
        sampler.start()
        warm_up(fleet, make_maker(args, shapes, seed_offset=1000), args)  # prompts the traces do not have
        patterns = [bursts_pattern(args, plan, maker, fleet),
                    steady_pattern(args, plan, maker, fleet, shapes, long_prompt, short)]
        if config == "elastic" and args.redeploy_seconds > 0:
            patterns.append(redeploy_pattern(args, plan, maker, fleet, shapes, long_prompt, short))
        for pattern in patterns:
            out["patterns"][pattern.name] = run_pattern(pattern, fleet, sampler, args, plan, out)
            print(f"   {pattern.name}: {out['patterns'][pattern.name]['duration_s']:.1f} s", flush=True)
        sampler.stop()
        out["samples"], out["server_samples"] = sampler.samples, sampler.server_samples
    except Exception as exc:  # noqa: BLE001 - the patterns done are kept; the report says this configuration failed
        traceback.print_exc()
        out["error"] = repr(exc)
    finally:
        for s in fleet.servers.values():
            s.stop()
        out["daemon_exit_codes"] = {name: d.proc.poll() if d.proc else None for name, d in fleet.daemons.items()}
        try:
            out["after_servers_left"] = leftovers(fleet)
        except Exception as exc:  # noqa: BLE001 - e.g. a daemon that died: its exit code is above
            out["after_servers_left"] = {"error": repr(exc)}
        fleet.stop()
    if "error" in out:
        print(f"   {config} FAILED: {out['error']}; daemons' exit codes {out['daemon_exit_codes']}", flush=True)
    return out


def run_pattern(pattern: Pattern, fleet: Fleet, sampler: Sampler, args, plan: Plan, out: dict) -> dict:
    t0 = time.perf_counter()
    offset = t0 - sampler.t0
    results, events = asyncio.run(drive(fleet, pattern.reqs, pattern.events, t0))
    duration = time.perf_counter() - t0
    time.sleep(2 * args.sample_every)  # a sample after the last request
    window = (offset, offset + duration)
    span = max(r.arrival for r in pattern.reqs)
    fig = {"duration_s": duration, "offset_s": offset, "arrivals_s": span,
           "per_model": {k: model_figures(results, k, duration, sampler, window, span, plan.chunk_bytes)
                         for k in ORDER},
           "device": device_figures(sampler.samples, fleet.daemons, window),
           "requests": results}
    for name in ("output_tok_per_s", "arrivals_output_tok_per_s"):
        fig[f"total_{name}"] = sum(m[name] for m in fig["per_model"].values())
    for e in events:
        if e["event"] == "snapshot":
            out["snapshots"].append({"pattern": pattern.name, **e})
        elif e["event"] == "restart":
            print(f"   {e['signal']} {e['model']}: ready again after {e['restart_seconds']:.1f} s, session reclaimed "
                  f"after {e['reclaimed_seconds']} s; long prompt warm TTFT {e['warm']['ttft']} s, "
                  f"{e['warm']['cached']} tokens cached", flush=True)
            # the cold time is the first probe's, which found nothing cached (a redeploy's probe before its
            # stop finds the prompt again: it only makes sure the server being stopped computed it)
            firsts = [r["cold"] for r in (*out["restarts"], e) if r["cold"] and r["cold"]["cached"] == 0]
            cold = firsts[0] if firsts else None
            e["pattern"] = pattern.name
            e["cold_ttft_ms"] = cold["ttft"] * 1e3 if cold and cold["ttft"] else None
            e["warm_ttft_ms"] = e["warm"]["ttft"] * 1e3 if e["warm"]["ttft"] else None
            e["warm_over_cold"] = (e["warm_ttft_ms"] / e["cold_ttft_ms"]
                                   if e["cold_ttft_ms"] and e["warm_ttft_ms"] is not None else None)
            e["others_during"] = during_crash(results, e, [k for k in ORDER if k != e["model"]])
            out["restarts"].append(e)
    if pattern.bursts:
        fig["memory_moves"] = memory_moves(sampler.samples, pattern, offset, args.burst_period, plan.chunk_bytes)
        fig["bursts"] = pattern.bursts
    return fig


def leftovers(fleet: Fleet) -> dict:
    """After every server stopped: nothing held, no session, the self-check clean (polled: grace periods)."""
    out = {}
    for name, d in fleet.daemons.items():
        deadline = time.monotonic() + 60
        while True:
            st = d.stats()
            held = sum(c.used_blocks for c in st.classes)
            if (st.clients == 0 and st.sequences == 0 and held == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ok, detail = d.check()
        out[name] = {"clients": st.clients, "sequences": st.sequences, "used_blocks": held,
                     "cached_blocks": sum(c.cached_blocks for c in st.classes), "check_ok": ok, "check": detail}
    return out


# -- report ------------------------------------------------------------------------------------------------
def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def report(runs: dict, plan: Plan, args) -> dict:
    header = ["config", "pattern", "model", "req (ok/int/fail)", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
              "out tok/s (arrivals / all)",
              "preempt", "prefix-hit tok", "chunks taken/released", "commit/release ms"]
    rows = []
    for config, run in runs.items():
        for pname, p in run["patterns"].items():
            for k, m in p["per_model"].items():
                rows.append([config, pname, k, f"{m['requests']} ({m['ok']}/{m['interrupted']}/{m['failed']})",
                             f"{fmt(m['ttft_p50_ms'])} / {fmt(m['ttft_p99_ms'])}",
                             f"{fmt(m['tpot_p50_ms'])} / {fmt(m['tpot_p99_ms'])}",
                             f"{fmt(m['arrivals_output_tok_per_s'])} / {fmt(m['output_tok_per_s'])}",
                             fmt(m["preemptions"], 0), m["prefix_hit_tokens"],
                             f"{m['chunks_taken']:.0f} / {m['chunks_released']:.0f}",
                             f"{m['commit_ms']:.1f} / {m['release_ms']:.1f}"])
    print_table(f"per model, {args.backend}, every configuration with {plan.pool_bytes / MiB:.0f} MiB of KV memory",
                header, rows)
    restart_rows = []
    for config, run in runs.items():
        for e in run["restarts"]:
            others = ", ".join(f"{k} {fmt(v['p99_before_ms'])}->{fmt(v['p99_during_ms'])} ms ({fmt(v['ratio'], 2)}x)"
                               for k, v in e["others_during"].items())
            restart_rows.append([config, e["signal"], e["model"], fmt(e["restart_seconds"]),
                                 fmt(e["reclaimed_seconds"]), fmt(e["first_request"]["ttft"] and
                                                                  e["first_request"]["ttft"] * 1e3),
                                 f"{fmt(e['cold_ttft_ms'])} / {fmt(e['warm_ttft_ms'])} ({fmt(e['warm_over_cold'], 3)}x)",
                                 f"{e['warm']['cached']} ({e['warm_promoted_blocks']} promoted)", others])
    if restart_rows:
        print_table("restarts of one server during the trace", ["config", "signal", "model", "down->ready s",
                    "session reclaimed s", "first request TTFT ms", "long prompt cold / warm TTFT ms",
                    "warm cached tokens", "others' p99 TTFT before->during"], restart_rows)
    targets = check_targets(runs)
    print("\ntargets (for the GPU run):")
    for t in targets:
        print(f"  {'PASS' if t['met'] else 'MISS' if t['met'] is False else 'n/a '}  {t['what']}: {t['value']}")
    return {"targets": targets}


def check_targets(runs: dict) -> list[dict]:
    out = []

    def add(what, value, met):
        out.append({"what": what, "value": value, "met": met})

    el, st = runs.get("elastic"), runs.get("static")
    if el and st:
        for k in ORDER:
            a, b = (r["patterns"]["bursts"]["per_model"][k]["ttft_p99_ms"] for r in (el, st))
            ratio = b / a if a and b else None
            add(f"bursts, {k}: static p99 TTFT / elastic p99 TTFT >= 2", fmt(ratio, 2),
                None if ratio is None else ratio >= 2)
        a, b = (r["patterns"]["steady"]["total_arrivals_output_tok_per_s"] for r in (el, st))
        add("steady: elastic output tok/s within 3% of static (while requests arrive)",
            f"{a:.1f} vs {b:.1f} ({100 * (a / b - 1):+.1f}%)" if b else "-", abs(a / b - 1) <= 0.03 if b else None)
    for config, run in runs.items():
        for e in run["restarts"]:
            r = e["warm_over_cold"]
            add(f"{config}, {e['signal']}: warm / cold TTFT of the long prompt <= 0.2", fmt(r, 3),
                None if r is None else r <= 0.2)
            for k, v in e["others_during"].items():
                add(f"{config}, {e['signal']}: {k}'s p99 TTFT during / before the restart <= 1.10", fmt(v["ratio"], 2),
                    None if v["ratio"] is None else v["ratio"] <= 1.10)
        for name, left in run["after_servers_left"].items():
            add(f"{config}: {name} after the servers stopped: no session, nothing held, self-check clean",
                f"clients {left['clients']}, used blocks {left['used_blocks']}, check {left['check_ok']}",
                left["clients"] == 0 and left["used_blocks"] == 0 and left["check_ok"])
    return out


def build_models(args, shapes_only: bool = False) -> tuple[dict, dict]:
    """(model directories, shapes); the directories are built unless ``--model-dirs`` has them."""
    base = args.model_dirs or tempfile.mkdtemp(prefix="bench-multimodel-")
    dirs, shapes = {}, {}
    tiny = args.backend == "cpu"
    for i, k in enumerate(ORDER):
        spec = MODELS[k]
        dirs[k] = str(Path(base) / k)
        shapes[k] = shape_of(k, spec.tiny() if tiny else spec.published(), args.dtype, 16)
        if not (Path(dirs[k]) / "config.json").is_file():
            t = time.perf_counter()
            build_model_dir(spec, dirs[k], tiny=tiny, dtype=args.dtype, device=args.device, seed=args.seed + i)
            print(f"built {k} in {dirs[k]} ({time.perf_counter() - t:.1f} s)", flush=True)
    return dirs, shapes


def stop_on_sigterm(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


def report_again(path: str) -> None:
    """``--report``: the tables, targets and picture of a stored run (its JSON gains the targets and picture)."""
    payload = json.loads(Path(path).read_text())
    args, plan = argparse.Namespace(**payload["args"]), Plan(**payload["plan"])
    summary = report(payload["runs"], plan, args)
    png = draw(payload["runs"], Path(path).with_suffix(".png"), args)
    Path(path).write_text(json.dumps({**payload, **summary, "png": png}, indent=2))


def draw(runs: dict, png: Path, args) -> str | None:
    """The TTFT-over-time picture (``_multimodel_plot``), or None without matplotlib."""
    try:
        from _multimodel_plot import plot
    except ImportError as exc:
        print(f"no picture: {exc} (pip install matplotlib)")
        return None
    plot(runs, png, crash_model=args.crash_model)
    print(f"wrote {png}")
    return str(png)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        report_again(args.report)
        return
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # a timeout stops the daemons and servers started here too
    started = time.perf_counter()
    model_dirs, shapes = build_models(args)
    plan = make_plan(args, shapes, make_maker(args, shapes))
    print(json.dumps({"plan": asdict(plan), "token_bytes": {k: s.token_bytes for k, s in shapes.items()}}, indent=1))
    workdir = tempfile.mkdtemp(prefix="bench-multimodel-run-")
    print(f"run logs: {workdir}", flush=True)
    stamp = f"multimodel_{args.backend}_{time.strftime('%Y%m%dT%H%M%S')}"
    payload = {"args": vars(args), "plan": asdict(plan),
               "shapes": {k: {**asdict(s), "token_bytes": s.token_bytes, "geometry": s.geometry}
                          for k, s in shapes.items()}, "logs": workdir}
    runs = {}
    for config in args.configs:
        runs[config] = run_config(config, args, plan, shapes, model_dirs, workdir)
        write_json(stamp, {**payload, "runs": runs, "seconds": time.perf_counter() - started})  # kept if cut short
    summary = report(runs, plan, args)
    png = draw(runs, RESULTS / f"{stamp}.png", args)
    write_json(stamp, {**payload, "runs": runs, **summary, "png": png, "seconds": time.perf_counter() - started})
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
