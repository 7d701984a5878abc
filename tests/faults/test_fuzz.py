"""Fuzzing every RPC through the raw stub.

Random and malformed fields, wrong and foreign session tokens, foreign and huge
ids, torn packed arrays, huge counts, and undecodable request bytes.  Only the
documented status codes may come back (never INTERNAL or UNKNOWN), the daemon
stays up and its self-check passes after every example.  The number of inputs
tried is printed (run with ``-s``) and written to ``$KVPOOL_FUZZ_REPORT`` when set.
"""

from __future__ import annotations

import json
import os

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from faultkit import LAYOUT, admin_of
from kvpool.protocol import kvpool_pb2 as pb
from kvpool.protocol import kvpool_pb2_grpc as pb_grpc

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
}
EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_EXAMPLES", "400"))
HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]


class World:
    """The daemon, two attached clients (ours and a foreign one) and the raw stubs."""

    def __init__(self, daemon):
        self.d = daemon
        self.tried = 0
        self.codes: dict[str, int] = {}
        self.chan = grpc.insecure_channel("unix://" + daemon.socket)
        self.admin_chan = grpc.insecure_channel("unix://" + admin_of(daemon.socket))
        self.stub = pb_grpc.KVPoolStub(self.chan)
        self.admin = pb_grpc.KVPoolStub(self.admin_chan)
        self.clients: list = []
        self.reattach()

    def _close_clients(self):
        for c in self.clients:
            try:
                c.close()
            except kvpool.KvpoolError:
                pass

    def reattach(self):
        self._close_clients()
        self.mine = kvpool.connect(self.d.socket, name="fuzz", layout=LAYOUT)
        self.other = kvpool.connect(self.d.socket, name="foreign", layout=LAYOUT)
        self.clients = [self.mine, self.other]
        for c in self.clients:
            c.create_sequences([range(9), range(100, 103)])

    def alive(self) -> bool:
        try:
            self.stub.Sequences(pb.SequencesRequest(session=self.mine._token), timeout=10)
            self.stub.Sequences(pb.SequencesRequest(session=self.other._token), timeout=10)
            return True
        except grpc.RpcError:
            return False

    def ids(self, client) -> list[int]:
        try:
            return [s.seq_id for s in self.stub.Sequences(pb.SequencesRequest(session=client._token)).sequences]
        except grpc.RpcError:
            return []

    def close(self):
        self._close_clients()
        self.chan.close()
        self.admin_chan.close()


# -- strategies -------------------------------------------------------------------------------

def packed(dtype: str):
    """Well-formed packed arrays of any values, torn ones, and plain garbage."""
    info = np.iinfo(dtype)
    ints = st.lists(st.one_of(st.integers(info.min, info.max), st.integers(-3, 40)), max_size=12)
    whole = ints.map(lambda v: np.array(v, dtype).tobytes())
    return st.one_of(st.just(b""), whole, whole.map(lambda b: b[:-1] if b else b"\x01"),
                     st.binary(max_size=40))


@st.composite
def session_token(draw, world_ref):
    w = world_ref[0]
    kind = draw(st.sampled_from(["mine", "mine", "mine", "foreign", "empty", "random", "torn"]))
    if kind == "mine":
        return w.mine._token
    if kind == "foreign":
        return w.other._token
    if kind == "empty":
        return b""
    if kind == "torn":
        return w.mine._token[: draw(st.integers(0, len(w.mine._token) - 1))]
    return draw(st.binary(max_size=64))


@st.composite
def seq_ids(draw, world_ref, max_size=6):
    # the draws never depend on the daemon's state (hypothesis replays them); only the mapping does
    w = world_ref[0]
    picks = draw(st.lists(st.one_of(st.tuples(st.just("live"), st.integers(0, 1000)), st.integers(0, 64),
                                    st.sampled_from(HUGE[2:])), max_size=max_size))
    pool = w.ids(w.mine) + w.ids(w.other) if any(isinstance(p, tuple) for p in picks) else []
    return [(pool[p[1] % len(pool)] if pool else p[1] % 8) if isinstance(p, tuple) else p for p in picks]


def tokens():
    return st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=40).map(lambda v: np.array(v, "<u4").tobytes()),
                     st.binary(max_size=41))


def layouts():
    return st.builds(
        pb.Layout, model_id=st.one_of(st.just(LAYOUT.model_id), st.text(max_size=12)),
        revision=st.text(max_size=4),
        num_layers=st.one_of(st.integers(0, 4), st.sampled_from(HUGE[:3])),
        num_kv_heads=st.one_of(st.integers(0, 4), st.sampled_from(HUGE[:3])),
        head_dim=st.one_of(st.sampled_from([0, 1, 3, 8, 16]), st.sampled_from(HUGE[:3])),
        dtype=st.sampled_from(["float16", "bfloat16", "float32", "float8_e4m3fn", "int7", ""]),
        block_size=st.one_of(st.sampled_from([0, 1, 4, 16, 3]), st.sampled_from(HUGE[:3])),
    )


def requests(world_ref):
    tok = session_token(world_ref)
    ids = seq_ids(world_ref)
    u32 = st.one_of(st.integers(0, 64), st.sampled_from(HUGE[:3]))
    prompt = st.builds(pb.Prompt, tokens=tokens(), extra_key=st.text(max_size=8))
    return st.one_of(
        st.tuples(st.just("Attach"), st.builds(pb.AttachRequest, name=st.text(max_size=10),
                                               layout=st.one_of(st.none(), layouts()),
                                               pid=st.one_of(st.just(os.getpid()), st.integers(0, 2**32 - 1)),
                                               device_bus_id=st.one_of(st.just(""), st.text(max_size=16),
                                                                       st.just("0000:00:00.0")))),
        st.tuples(st.just("Heartbeat"), st.builds(pb.HeartbeatRequest, session=tok)),
        st.tuples(st.just("Create"), st.builds(pb.CreateRequest, session=tok, prompts=st.lists(prompt, max_size=4),
                                               no_wait=st.booleans())),
        st.tuples(st.just("Step"), st.builds(
            pb.StepRequest, session=tok, seq_ids=st.one_of(ids.map(lambda v: np.array(v, "<u8").tobytes()),
                                                            packed("<i8")),
            token_counts=packed("<i4"), tokens=tokens(), claim_counts=packed("<i4"), claims=packed("<i4"),
            free_seq_ids=ids, reserve_target=u32, reserve_return=packed("<i4"))),
        st.tuples(st.just("Fork"), st.builds(pb.ForkRequest, session=tok, seq_ids=ids)),
        st.tuples(st.just("Lookup"), st.builds(pb.LookupRequest, session=tok, prompt=prompt)),
        st.tuples(st.just("Sequences"), st.builds(pb.SequencesRequest, session=tok,
                                                  session_id=st.one_of(st.integers(0, 8), st.sampled_from(HUGE)))),
        st.tuples(st.just("SwapOut"), st.builds(pb.SwapRequest, session=tok, seq_ids=ids, no_wait=st.booleans())),
        st.tuples(st.just("SwapIn"), st.builds(pb.SwapRequest, session=tok, seq_ids=ids, no_wait=st.booleans())),
        st.tuples(st.just("Wait"), st.builds(pb.WaitRequest, session=tok, seq_ids=ids)),
        st.tuples(st.just("Detach"), st.builds(pb.DetachRequest, session=st.one_of(
            st.binary(max_size=40), st.just(b"")))),  # never our own: the world keeps its sessions
        st.tuples(st.just("Evict"), st.builds(pb.EvictRequest, class_id=st.integers(-2**31, 2**31 - 1),
                                              max_blocks=st.one_of(st.integers(0, 8), st.sampled_from(HUGE)))),
        st.tuples(st.just("Drain"), st.builds(pb.DrainRequest, resume=st.booleans())),
        st.tuples(st.sampled_from(["Ping", "Stats", "Clients", "Check", "GetConfig"]), st.none()),
    )


EMPTY = {"Ping": pb.PingRequest, "Stats": pb.StatsRequest, "Clients": pb.ClientsRequest,
         "Check": pb.CheckRequest, "GetConfig": pb.GetConfigRequest}


@pytest.fixture(scope="module")
def world():
    import importlib.util
    from pathlib import Path

    # the top conftest's Daemon (module scope: one daemon for every example); loaded by path,
    # since "conftest" in sys.modules is whichever test folder's conftest came last
    spec = importlib.util.spec_from_file_location("kvpool_tests_top_conftest",
                                                  Path(__file__).resolve().parent.parent / "conftest.py")
    top = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top)
    Daemon = top.Daemon

    d = Daemon("--pool-bytes", "4MiB", "--chunk-bytes", "64KiB", "--host-bytes", "2MiB",
               "--grace-seconds", "60", "--max-sessions", "64", "--max-tokens-per-call", "64",
               "--max-sequences-per-session", "32", "--log-level", "warning").start()
    w = World(d)
    yield w
    w.close()
    report = os.environ.get("KVPOOL_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"inputs": w.tried, "codes": w.codes}, f, indent=1)
    print(f"\nfuzz: {w.tried} inputs tried; status codes {w.codes}")
    d.stop()


def _call(w: World, name: str, request, admin: bool):
    stub = w.admin if admin else w.stub
    w.tried += 1
    try:
        getattr(stub, name)(request, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED, f"{name}({request!r}) on the {'admin' if admin else 'normal'} socket " \
                                f"answered {code}: {exc.details()}"
    w.codes[code.name] = w.codes.get(code.name, 0) + 1
    return code


def _after(w: World):
    assert w.d.proc.poll() is None, "the daemon died:\n" + w.d.output()[-3000:]
    ok, detail = kvpool.Connection(w.d.socket).check()
    assert ok, detail
    if not w.alive():  # a reset or a limit dropped our sessions: attach again
        w.reattach()
    if w.stub.Stats(pb.StatsRequest()).draining:
        w.admin.Drain(pb.DrainRequest(resume=True))


def test_fuzz_every_rpc(world):
    ref = [world]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(calls=st.lists(st.tuples(requests(ref), st.booleans()), min_size=1, max_size=4))
    def run(calls):
        for (name, request), admin in calls:
            _call(world, name, request if request is not None else EMPTY[name](), admin)
        _after(world)

    run()
    assert world.tried >= EXAMPLES


@settings(max_examples=max(50, EXAMPLES // 4), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["Attach", "Create", "Step", "Fork", "Lookup", "Sequences", "SwapOut", "SwapIn",
                             "Wait", "Detach", "Evict", "Drain", "Stats", "Check", "Heartbeat"]),
       raw=st.binary(max_size=64), admin=st.booleans())
def test_fuzz_undecodable_bytes(world, name, raw, admin):
    """Bytes that are not a valid message of the method (wrong wire types, torn varints)."""
    chan = world.admin_chan if admin else world.chan
    call = chan.unary_unary(f"/kvpool.v1.KVPool/{name}")  # no serializers: raw bytes both ways
    world.tried += 1
    try:
        call(raw, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED, f"{name}({raw!r}) answered {code}: {exc.details()}"
    world.codes[code.name] = world.codes.get(code.name, 0) + 1
    _after(world)


def test_watch_with_wrong_tokens(world):
    for token in (b"", b"\x00" * 16, world.mine._token[:-1], os.urandom(32)):
        world.tried += 1
        with pytest.raises(grpc.RpcError) as info:
            next(iter(world.stub.Watch(pb.WatchRequest(session=token), timeout=10)))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _after(world)


def test_stopped_daemon_is_unavailable(daemon_factory):
    d = daemon_factory()
    stub = pb_grpc.KVPoolStub(grpc.insecure_channel("unix://" + d.socket))
    stub.Ping(pb.PingRequest(), timeout=10)
    d.stop()
    with pytest.raises(grpc.RpcError) as info:
        stub.Ping(pb.PingRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
