"""The bounds a value must respect to be usable end to end, and the gRPC message size they add up to."""

from __future__ import annotations

from .options import Config

# Upper bounds a value must respect to be usable end to end.  Counts of blocks,
# sequences and tokens travel as int32 (block ids, token counts) or uint32
# (reserve target) on the wire; sizes as uint64 and through off_t/mmap.
MAX_COUNT = 2**31 - 1
MAX_BYTES = 2**63 - 1
MAX_SECONDS = 365 * 86400.0  # asyncio timers overflow far above; a year is "never" for an operator
# The largest gRPC message either way (the daemon's replies; max_message_bytes at most).
# A call carries 4 bytes per token plus per-sequence arrays; at 8 bytes per token the
# most tokens one call may carry still fits, so max_tokens_per_call answers first.
MAX_MESSAGE_BYTES = 256 << 20
MAX_TOKENS_PER_CALL = MAX_MESSAGE_BYTES // 8
# What the largest legitimate request needs on the wire (``receive_limit``): per token its
# id and a claimed block (4 + 4 bytes); per sequence its id, count, claim count, a freed id
# and a prompt's framing (64 bytes); per reserve block a return (8); strings (name, model
# id, extra keys) room for 16 of the longest; and the message's own framing.
EXTRA_KEY_FACTOR = 4  # an extra key (a LoRA id, an adapter list) may have this many times max_string_bytes
TOKEN_WIRE_BYTES = 8
SEQUENCE_WIRE_BYTES = 64
RESERVE_WIRE_BYTES = 8
STRINGS_PER_CALL = 16
MESSAGE_SLACK_BYTES = 64 << 10
# caps on what one user may hold at once (0: none); each is counted per uid
PER_USER_CAPS = ("max_tickets_per_user", "max_sessions_per_user", "max_handoff_connections_per_user")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
SUN_PATH_MAX = 107


def needed_message_bytes(cfg: Config) -> int:
    """The largest request a client may send within the per-call and per-session limits (``MAX_MESSAGE_BYTES``
    when one of them is off)."""
    if not (cfg.max_tokens_per_call and cfg.max_sequences_per_session and cfg.max_string_bytes):
        return MAX_MESSAGE_BYTES
    need = (TOKEN_WIRE_BYTES * cfg.max_tokens_per_call + SEQUENCE_WIRE_BYTES * cfg.max_sequences_per_session
            + RESERVE_WIRE_BYTES * cfg.max_reserve_blocks
            + STRINGS_PER_CALL * EXTRA_KEY_FACTOR * cfg.max_string_bytes + MESSAGE_SLACK_BYTES)
    return min(need, MAX_MESSAGE_BYTES)


def receive_limit(cfg: Config) -> int:
    """The gRPC servers' receive limit: ``max_message_bytes``, or what the limits need (0)."""
    return cfg.max_message_bytes or needed_message_bytes(cfg)
