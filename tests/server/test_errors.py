"""Bad requests get the documented status codes, and the daemon stays up and intact."""

from __future__ import annotations

import numpy as np
import pytest

import kvpool
from kvpool.protocol import kvpool_pb2 as pb

LAYOUT = kvpool.Layout("err-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


@pytest.fixture
def two_clients(daemon):
    a = kvpool.connect(daemon.socket, name="a", layout=LAYOUT)
    b = kvpool.connect(daemon.socket, name="b", layout=LAYOUT)
    yield a, b
    a.close()
    b.close()


def raw_step(client, **fields):
    return client._conn.call("Step", pb.StepRequest(session=client._token, **fields))


def test_status_codes_for_bad_requests(daemon, two_clients):
    a, b = two_clients
    seq = a.create_sequence(range(6))
    before = a.stats()

    with pytest.raises(kvpool.NotFound, match="does not exist"):  # unknown sequence
        raw_step(a, seq_ids=np.array([12345], "<i8").tobytes(), token_counts=np.array([1], "<i4").tobytes(),
                 tokens=np.array([1], "<u4").tobytes())
    with pytest.raises(kvpool.PermissionDenied, match="another session"):  # b names a's sequence
        raw_step(b, seq_ids=np.array([seq.id], "<i8").tobytes(), token_counts=np.array([1], "<i4").tobytes(),
                 tokens=np.array([1], "<u4").tobytes())
    with pytest.raises(kvpool.InvalidArgument, match="add up"):  # counts and tokens disagree
        raw_step(a, seq_ids=np.array([seq.id], "<i8").tobytes(), token_counts=np.array([3], "<i4").tobytes(),
                 tokens=np.array([1], "<u4").tobytes())
    with pytest.raises(kvpool.InvalidArgument, match="whole number"):  # a torn packed array
        raw_step(a, seq_ids=b"\x01\x02\x03")
    with pytest.raises(kvpool.InvalidArgument):  # tokens of the wrong type, caught in the client
        a.create_sequence(["x", "y"])
    with pytest.raises(kvpool.InvalidArgument, match="not in this session's reserve"):
        raw_step(a, seq_ids=np.array([seq.id], "<i8").tobytes(), token_counts=np.array([4], "<i4").tobytes(),
                 tokens=np.arange(4, dtype="<u4").tobytes(), claim_counts=np.array([1], "<i4").tobytes(),
                 claims=np.array([0], "<i4").tobytes())
    # more than the 64 MiB pool holds, in the most tokens one call may carry (max_tokens_per_call)
    wide = kvpool.Layout("err-wide", num_layers=4, num_kv_heads=1, head_dim=128, dtype="float16", block_size=4)
    with kvpool.connect(daemon.socket, layout=wide, name="wide") as w:
        with pytest.raises(kvpool.OutOfBlocks, match="needed"):
            w.create_sequence(np.zeros(1 << 20, np.int64))
    with pytest.raises(kvpool.SessionExpired):
        a._conn.call("Step", pb.StepRequest(session=b"forged-session-token"))
    with pytest.raises(kvpool.InvalidArgument, match="block_size|positive"):
        a._conn.call("Attach", pb.AttachRequest(name="x", layout=pb.Layout(model_id="m", num_layers=0)))
    with pytest.raises(kvpool.InvalidArgument, match="layout"):
        a._conn.call("Attach", pb.AttachRequest(name="x"))
    # a dtype no kernel takes (the client's Layout refuses it too, so the raw message)
    e5m2 = pb.Layout(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float8_e5m2", block_size=4)
    with pytest.raises(kvpool.InvalidArgument, match=r"dtypes a kernel takes.*float8_e4m3fn.*float8_e5m2"):
        a._conn.call("Attach", pb.AttachRequest(name="x", layout=e5m2))

    after = a.stats()
    assert after.classes[0].used_blocks == before.classes[0].used_blocks  # nothing leaked
    assert after.sequences == before.sequences == 1
    assert a._conn.check()[0]
    a.extend({seq: [1, 2]})  # and the session still works
    assert seq.num_tokens == 8


def test_copy_on_write_with_claims_is_a_failed_precondition(daemon, two_clients):
    a, _ = two_clients
    seq = a.create_sequence(range(6))
    a.fork(seq)
    a.flush()  # fills the reserve
    block = a._mirror.reserve[-1]
    with pytest.raises(kvpool.FailedPrecondition, match="shares its last block"):
        raw_step(a, seq_ids=np.array([seq.id], "<i8").tobytes(), token_counts=np.array([3], "<i4").tobytes(),
                 tokens=np.arange(3, dtype="<u4").tobytes(), claim_counts=np.array([1], "<i4").tobytes(),
                 claims=np.array([block], "<i4").tobytes())


def test_unreachable_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(kvpool.Unavailable, match="not reachable"):
        kvpool.connect(str(tmp_path / "no.sock"), name="x", layout=LAYOUT, timeout=2)
