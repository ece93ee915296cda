"""safetensors read/write without the safetensors package (Debian's python3 has none); shared by the golden
generators under tests/golden/ (jepa_reference.py, sd_reference.py). Not run by CI.

Layout written: 8-byte little-endian header length, JSON header padded with spaces to a multiple of 8 so the data
section starts 8-byte aligned, then the tensors' bytes in header order. `__metadata__` holds {str: str}.
"""
import json
import struct

import numpy as np
import torch

_DTYPES = {
    torch.float32: ("F32", "<f4"),
    torch.float64: ("F64", "<f8"),
    torch.float16: ("F16", "<f2"),
    torch.int64: ("I64", "<i8"),
    torch.int32: ("I32", "<i4"),
    torch.bool: ("BOOL", "|b1"),
    torch.uint8: ("U8", "|u1"),
}
_NP_FROM_NAME = {name: npd for name, npd in _DTYPES.values()}


def write_st(path, tensors, metadata):
    """tensors: list of (name, tensor) in file order (or a dict, written in its order); metadata: {str: str}
    or None (no __metadata__ entry)."""
    if isinstance(tensors, dict):
        tensors = list(tensors.items())
    header, blobs, off = {}, [], 0
    for name, t in tensors:
        assert name not in header, name
        dname, npd = _DTYPES[t.dtype]
        b = t.detach().contiguous().cpu().numpy().astype(npd, copy=False).tobytes()
        header[name] = {"dtype": dname, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata is not None:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), metadata
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)  # pad with spaces so the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_st_bytes(raw):
    """Returns ({name: tensor} in file order, metadata) from the bytes of a safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    data = raw[8 + n:]
    out, end_max = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e_ = e["data_offsets"]
        arr = np.frombuffer(data[b:e_], dtype=_NP_FROM_NAME[e["dtype"]]).reshape(e["shape"])
        out[name] = torch.from_numpy(arr.copy())
        end_max = max(end_max, e_)
    assert end_max == len(data), (end_max, len(data))
    return out, meta


def read_st(path):
    """Returns ({name: tensor} in file order, metadata)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return read_st_bytes(raw)
    except AssertionError as e:
        raise AssertionError(f"{path}: {e}") from None
