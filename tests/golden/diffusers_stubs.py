"""Import huggingface/diffusers from a source checkout under Debian's python3-torch 1.13, without the
huggingface_hub and safetensors packages. Shared by tests/golden/sd_reference.py (the goldens) and
bench/sd_peer.py (`dew bench --models sd_unet,sd_vae`). Not run by CI.

    sys.path.insert(0, "tests/golden")
    import diffusers_stubs
    diffusers = diffusers_stubs.import_diffusers("/tmp/diffusers_src/src", "/tmp/dew_diffusers_stubs/site")

What it installs (install()):
- fake `*.dist-info/METADATA` for the stubbed packages in `site` (appended to sys.path), so diffusers'
  importlib.metadata checks see them as installed (the version numbers are labels only);
- huggingface_hub: constants, error classes, `validate_hf_hub_args` as the identity decorator, a one-shard
  `split_torch_state_dict_into_shards`; every network function raises;
- safetensors: `safetensors.torch.save_file/load_file/load` and `safe_open` on tests/golden/st_io.py;
- torch >= 2.1 names diffusers touches at import: `torch.compiler.disable` (identity decorator) and sentinel
  `torch.float8_e4m3fn` / `torch.float8_e5m2` (torchao quantizer tables only).
"""
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_io import read_st, read_st_bytes, write_st  # noqa: E402

# The labels the fake dist-info carry for the stubbed packages.
VERSIONS = {"huggingface_hub": "0.27.0", "safetensors": "0.4.5"}


def module(name, package=False, **attrs):
    """A new module `name` in sys.modules (and as an attribute of its parent) holding `attrs`."""
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, m)
    return m


def fake_dist_info(site, versions):
    """`{pkg}-{ver}.dist-info` with METADATA and top_level.txt for every package of `versions`, under `site`."""
    for pkg, ver in versions.items():
        d = os.path.join(site, f"{pkg}-{ver}.dist-info")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {ver}\n")
        with open(os.path.join(d, "top_level.txt"), "w") as f:
            f.write(pkg + "\n")
    if site not in sys.path:
        sys.path.append(site)


def _offline(name):
    def f(*args, **kwargs):
        raise RuntimeError(f"huggingface_hub.{name}: stub, no hub access (tests/golden/diffusers_stubs.py)")

    f.__name__ = name
    return f


def install_hub_stub(version=VERSIONS["huggingface_hub"]):
    hub = module("huggingface_hub", package=True, __version__=version)
    module("huggingface_hub.constants", HF_HOME=os.path.expanduser("~/.cache/huggingface"),
           HF_HUB_DISABLE_TELEMETRY=True, HF_HUB_OFFLINE=True)
    errors = {n: type(n, (Exception,), {}) for n in (
        "EntryNotFoundError", "LocalEntryNotFoundError", "OfflineModeIsEnabled", "RepositoryNotFoundError",
        "RevisionNotFoundError")}
    module("huggingface_hub.utils", package=True, validate_hf_hub_args=lambda fn: fn,
           is_jinja_available=lambda: False, **errors)
    module("huggingface_hub.file_download", REGEX_COMMIT_HASH=re.compile(r"^[0-9a-f]{40}$"))
    module("huggingface_hub._commit_api", CommitOperationAdd=type("CommitOperationAdd", (), {}))

    @dataclass
    class StateDictSplit:
        is_sharded: bool
        metadata: dict
        filename_to_tensors: dict
        tensor_to_filename: dict

    def split_torch_state_dict_into_shards(state_dict, *, filename_pattern="model{suffix}.safetensors",
                                           max_shard_size=None):
        """One shard (the tiny models are far below any max_shard_size)."""
        name = filename_pattern.format(suffix="")
        keys = list(state_dict.keys())
        return StateDictSplit(False, {"total_size": 0}, {name: keys}, {k: name for k in keys})

    hub.split_torch_state_dict_into_shards = split_torch_state_dict_into_shards
    hub.DDUFEntry = type("DDUFEntry", (), {})
    hub.ModelCard = type("ModelCard", (), {})
    hub.ModelCardData = type("ModelCardData", (), {})
    for n in ("create_commit", "create_repo", "hf_hub_download", "model_info", "read_dduf_file",
              "snapshot_download", "upload_folder"):
        setattr(hub, n, _offline(n))


def install_safetensors_stub(version=VERSIONS["safetensors"]):
    st = module("safetensors", package=True, __version__=version)

    def save_file(tensors, filename, metadata=None):
        write_st(filename, sorted(tensors.items()), metadata)

    def load_file(filename, device="cpu"):
        return dict(read_st(filename)[0])

    def load(data):
        return dict(read_st_bytes(data)[0])

    class safe_open:
        def __init__(self, filename, framework="pt", device="cpu"):
            self._t, self._m = read_st(filename)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return list(self._t.keys())

        def get_tensor(self, name):
            return self._t[name]

        def metadata(self):
            return self._m

    st.safe_open = safe_open
    module("safetensors.torch", save_file=save_file, load_file=load_file, load=load)


def install_torch_shims():
    """The torch >= 2.1 names diffusers touches at import, on an older torch (no-ops on a newer one)."""
    for name in ("float8_e4m3fn", "float8_e5m2"):  # named in diffusers' torchao quantizer tables only
        if not hasattr(torch, name):
            setattr(torch, name, type(name, (), {"__repr__": lambda self, n=name: f"<stub torch.{n}>"})())
    if not hasattr(torch, "compiler"):  # diffusers only decorates with torch.compiler.disable

        def _compiler_disable(fn=None, recursive=True):
            return fn if fn is not None else (lambda f: f)

        torch.compiler = types.SimpleNamespace(disable=_compiler_disable, is_compiling=lambda: False)


def install(site, versions=VERSIONS, only_missing=False):
    """The torch shims, the fake dist-info of `versions` under `site`, and the huggingface_hub and safetensors
    stubs. only_missing: leave a package that is really installed alone (no stub, no dist-info)."""
    install_torch_shims()
    stubs = {"huggingface_hub": install_hub_stub, "safetensors": install_safetensors_stub}
    if only_missing:
        stubs = {k: v for k, v in stubs.items() if importlib.util.find_spec(k) is None}
        versions = {k: v for k, v in versions.items() if k in stubs or k not in VERSIONS}
    fake_dist_info(site, versions)
    for pkg, install_stub in stubs.items():
        install_stub(versions[pkg])


def import_diffusers(src, site, version="0.34.0"):
    """diffusers from the checkout's `src` folder (the parent of diffusers/), with the stubs of install() for
    the packages this python lacks. Raises ImportError saying why when it cannot."""
    if not os.path.isfile(os.path.join(src, "diffusers", "__init__.py")):
        raise ImportError(f"no diffusers source at {src} (expected {os.path.join(src, 'diffusers', '__init__.py')})")
    install(site, only_missing=True)
    sys.path.insert(0, os.path.abspath(src))
    import diffusers

    if version and diffusers.__version__ != version:
        raise ImportError(f"diffusers {diffusers.__version__} at {src}, expected {version}")
    return diffusers
