"""safetensors read/write for the golden generators under tests/golden/, on the installed `safetensors` package
(requirements.txt pins it). Not run by CI.

write_st(path, tensors, metadata): tensors is a list of (name, tensor) or a dict; metadata {str: str} or None.
The package lays the file out itself (tensors ordered by dtype alignment, then name); readers look tensors up by
name, so the order given is not kept. read_st(path) -> ({name: tensor}, metadata).
"""
import safetensors
from safetensors import safe_open
from safetensors.torch import save_file

VERSION = safetensors.__version__


def write_st(path, tensors, metadata):
    if not isinstance(tensors, dict):
        items = list(tensors)
        tensors = dict(items)
        assert len(tensors) == len(items), "duplicate tensor names"
    if metadata is not None:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), metadata
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, path, metadata=metadata)


def read_st(path):
    """({name: tensor}, metadata) of a safetensors file."""
    with safe_open(path, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


__all__ = ["write_st", "read_st", "VERSION"]
