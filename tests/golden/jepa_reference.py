"""JEPA goldens from the reference code of facebookresearch/ijepa and facebookresearch/jepa (V-JEPA), run
under the project's environment (requirements.txt: torch 2.13.0, safetensors 0.8.0) on tiny configurations.
Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/jepa_reference.py

The reference classes are imported from checkouts of the two repositories, never from copies in this
project: IJEPA_SRC / VJEPA_SRC name the checkouts; when unset, the script exports HEAD of the bare mirrors
(IJEPA_MIRROR / VJEPA_MIRROR, default /work/.mirror/facebookresearch+{ijepa,jepa}/repo) into
/tmp/ijepa_src and /tmp/vjepa_src. Both repositories have a top-level `src` package, so ijepa is imported
first and its `src*` modules and path are removed before V-JEPA is imported.

Each case builds the reference module under torch.manual_seed(fixed), moves every trainable parameter off
its initialisation (p += 0.2 randn, i.e. LayerNorm weight 1 + 0.2 randn, biases 0.2 randn), leaves the
fixed sin-cos pos_embed as the reference builds it (float64 numpy table cast to float32), and runs
model.eval() twice: in float32 ("*_f32") and as a .double() deep copy on the same inputs widened to
float64 ("*_f64"). Weights and inputs are stored float32 (the f64 run uses exactly those values).

ijepa and V-JEPA are not pip packages, so they come from checkouts of the public repositories (as above); the
torch they run on is the installed one, with nothing stubbed.

Output: tests/golden/jepa/<case>.safetensors, written with the safetensors package (write_st of
tests/golden/st_io.py), and read back (read_st) to check the round trip. See tests/golden/jepa/README.md for
the contents.
"""
import copy
import json
import os
import subprocess
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "jepa")
MIRRORS = {
    "ijepa": os.environ.get("IJEPA_MIRROR", "/work/.mirror/facebookresearch+ijepa/repo"),
    "vjepa": os.environ.get("VJEPA_MIRROR", "/work/.mirror/facebookresearch+jepa/repo"),
}
REPO_NAMES = {"ijepa": "facebookresearch/ijepa", "vjepa": "facebookresearch/jepa"}


# ----------------------------------------------------------------------------------------------------
# safetensors: tests/golden/st_io.py (the safetensors package; shared by the golden scripts)
# ----------------------------------------------------------------------------------------------------
sys.path.insert(0, HERE)
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# reference imports
# ----------------------------------------------------------------------------------------------------
# torch 2 has F.scaled_dot_product_attention, which V-JEPA's src/models/utils/modules.py calls: nothing is stubbed.
SDPA_NOTE = "native F.scaled_dot_product_attention (torch %s; float64 on the CPU for the f64 runs)" % torch.__version__


def _checkout(kind):
    env = {"ijepa": "IJEPA_SRC", "vjepa": "VJEPA_SRC"}[kind]
    mirror = MIRRORS[kind]
    commit = subprocess.check_output(["git", "-C", mirror, "rev-parse", "HEAD"], text=True).strip()
    src = os.environ.get(env)
    if not src:
        src = f"/tmp/{kind}_src"
        if not os.path.isdir(os.path.join(src, "src")):
            os.makedirs(src, exist_ok=True)
            archive = subprocess.Popen(["git", "-C", mirror, "archive", "HEAD"], stdout=subprocess.PIPE)
            subprocess.check_call(["tar", "-x", "-C", src], stdin=archive.stdout)
            assert archive.wait() == 0
    return os.path.abspath(src), commit


def _drop_src_modules(path):
    for name in list(sys.modules):
        if name == "src" or name.startswith("src."):
            del sys.modules[name]
    while path in sys.path:
        sys.path.remove(path)


IJEPA_PATH, IJEPA_COMMIT = _checkout("ijepa")
sys.path.insert(0, IJEPA_PATH)
import src.models.vision_transformer as ij_vit  # noqa: E402
import src.masks.utils as ij_masks  # noqa: E402
import src.utils.tensors as ij_tensors  # noqa: E402
assert os.path.abspath(ij_vit.__file__).startswith(IJEPA_PATH), ij_vit.__file__
_drop_src_modules(IJEPA_PATH)

VJEPA_PATH, VJEPA_COMMIT = _checkout("vjepa")
sys.path.insert(0, VJEPA_PATH)
import src.models.vision_transformer as vj_vit  # noqa: E402
import src.models.predictor as vj_pred  # noqa: E402
assert os.path.abspath(vj_vit.__file__).startswith(VJEPA_PATH), vj_vit.__file__
_drop_src_modules(VJEPA_PATH)

SOURCE = {
    "ijepa": f"{REPO_NAMES['ijepa']}@{IJEPA_COMMIT}",
    "vjepa": f"{REPO_NAMES['vjepa']}@{VJEPA_COMMIT}",
}


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
LN6 = partial(nn.LayerNorm, eps=1e-6)
DIFFS = []  # (case, output, max |f32 - f64|)


@torch.no_grad()
def perturb(model, seed):
    """Moves every trainable parameter off its initialisation; fixed (requires_grad=False) ones stay."""
    g = torch.Generator().manual_seed(seed)
    ln_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.LayerNorm)}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        r = 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float32)
        if id(p) in ln_weights:
            p.copy_(1.0 + r)
        elif name.endswith(".bias"):
            p.copy_(r)
        else:
            p.add_(r)
    return model


def weights(model, prefix="w.", rename=None):
    out = []
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32, (k, v.dtype)
        k2 = (rename or {}).get(k, k)
        out.append((prefix + k2, v.clone()))
    return out


def randn(shape, g):
    return torch.randn(shape, generator=g, dtype=torch.float32)


def disjoint_masks(B, N, sizes, g):
    """For each batch row, disjoint sets of distinct sorted indices in [0, N), one set per size."""
    out = [torch.empty(B, s, dtype=torch.int64) for s in sizes]
    for b in range(B):
        perm = torch.randperm(N, generator=g)
        at = 0
        for i, s in enumerate(sizes):
            out[i][b] = perm[at:at + s].sort().values
            at += s
    return out


def both(case, name, f32, f64):
    d = (f32.double() - f64).abs().max().item()
    DIFFS.append((case, name, d))
    return [(name + "_f32", f32.detach().float().contiguous()), (name + "_f64", f64.detach().double().contiguous())]


def save(case, tensors, config, source, extra=None):
    meta = {"config": json.dumps(config, sort_keys=True), "source": source,
            "generator": "tests/golden/jepa_reference.py", "torch": torch.__version__, "attention": SDPA_NOTE,
            "versions": json.dumps({"torch": torch.__version__, "safetensors": ST_VERSION})}
    meta.update(extra or {})
    path = os.path.join(OUT_DIR, case + ".safetensors")
    write_st(path, tensors, meta)
    back, meta_back = read_st(path)
    assert meta_back == meta
    assert sorted(back) == sorted(n for n, _ in tensors), "tensor names"
    for n, t in tensors:
        assert back[n].dtype == t.dtype and back[n].shape == t.shape and torch.equal(back[n], t), n
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")


# ----------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------
IJ_ENC = dict(img_size=[16], patch_size=4, in_chans=2, embed_dim=32, depth=2, num_heads=4, mlp_ratio=4,
              qkv_bias=True)
IJ_PRED = dict(num_patches=16, embed_dim=32, predictor_embed_dim=16, depth=2, num_heads=2, mlp_ratio=4,
               qkv_bias=True)
VJ_ENC = dict(img_size=8, patch_size=4, num_frames=4, tubelet_size=2, in_chans=2, embed_dim=32, depth=2,
              num_heads=2, mlp_ratio=4, qkv_bias=True)
VJ_PRED = dict(img_size=8, patch_size=4, num_frames=4, tubelet_size=2, embed_dim=32, predictor_embed_dim=16,
               depth=2, num_heads=2, mlp_ratio=4, qkv_bias=True, use_mask_tokens=True, num_mask_tokens=1,
               zero_init_mask_tokens=False)


def cfg(d):
    return dict(d, norm_layer="partial(nn.LayerNorm, eps=1e-6)")


def build(cls, kw, seed):
    torch.manual_seed(seed)
    m = cls(**kw, norm_layer=LN6)
    return perturb(m, seed + 1000).eval()


def case_ijepa_encoder():
    case = "ijepa_encoder"
    enc = build(ij_vit.VisionTransformer, IJ_ENC, 1)
    g = torch.Generator().manual_seed(11)
    x = randn([2, 2, 16, 16], g)
    (mask,) = disjoint_masks(2, 16, [7], g)
    enc64 = copy.deepcopy(enc).double()
    with torch.no_grad():
        full32, masked32 = enc(x), enc(x, masks=[mask])
        full64, masked64 = enc64(x.double()), enc64(x.double(), masks=[mask])
    t = weights(enc) + [("x", x), ("mask", mask)]
    t += both(case, "full", full32, full64) + both(case, "masked", masked32, masked64)
    save(case, t, dict(cfg(IJ_ENC), calls={"full": "forward(x)", "masked": "forward(x, masks=[mask])"}),
         SOURCE["ijepa"] + " src/models/vision_transformer.py:VisionTransformer")


def case_ijepa_predictor():
    case = "ijepa_predictor"
    pred = build(ij_vit.VisionTransformerPredictor, IJ_PRED, 2)
    g = torch.Generator().manual_seed(12)
    ctx = randn([2, 7, 32], g)
    masks_x, m0, m1 = disjoint_masks(2, 16, [7, 4, 4], g)
    masks = torch.stack([m0, m1])
    pred64 = copy.deepcopy(pred).double()
    with torch.no_grad():
        out32 = pred(ctx, [masks_x], [masks[0], masks[1]])
        out64 = pred64(ctx.double(), [masks_x], [masks[0], masks[1]])
    assert out32.shape == (4, 4, 32)
    t = weights(pred) + [("ctx", ctx), ("masks_x", masks_x), ("masks", masks)]
    t += both(case, "out", out32, out64)
    save(case, t, dict(cfg(IJ_PRED), calls={"out": "forward(ctx, [masks_x], [masks[0], masks[1]])"},
                       out_layout="[M*B, K, embed_dim], mask-major (row m*B + b)"),
         SOURCE["ijepa"] + " src/models/vision_transformer.py:VisionTransformerPredictor")


def case_vjepa_encoder():
    case = "vjepa_encoder"
    enc = build(vj_vit.VisionTransformer, VJ_ENC, 3)
    g = torch.Generator().manual_seed(13)
    x = randn([2, 2, 4, 8, 8], g)
    (mask,) = disjoint_masks(2, 8, [5], g)
    enc64 = copy.deepcopy(enc).double()
    with torch.no_grad():
        full32, masked32 = enc(x), enc(x, masks=[mask])
        full64, masked64 = enc64(x.double()), enc64(x.double(), masks=[mask])
    assert full32.shape == (2, 8, 32) and masked32.shape == (2, 5, 32)
    t = weights(enc) + [("x", x), ("mask", mask)]
    t += both(case, "full", full32, full64) + both(case, "masked", masked32, masked64)
    save(case, t, dict(cfg(VJ_ENC), calls={"full": "forward(x)", "masked": "forward(x, masks=[mask])"}),
         SOURCE["vjepa"] + " src/models/vision_transformer.py:VisionTransformer")


def case_vjepa_predictor():
    case = "vjepa_predictor"
    pred = build(vj_pred.VisionTransformerPredictor, VJ_PRED, 4)
    g = torch.Generator().manual_seed(14)
    ctx = randn([2, 5, 32], g)
    masks_x, m0 = disjoint_masks(2, 8, [5, 3], g)
    masks = m0.unsqueeze(0)
    pred64 = copy.deepcopy(pred).double()
    with torch.no_grad():
        out32 = pred(ctx, None, [masks_x], [masks[0]], mask_index=0)
        out64 = pred64(ctx.double(), None, [masks_x], [masks[0]], mask_index=0)
    assert out32.shape == (2, 3, 32)
    rename = {"mask_tokens.0": "mask_token"}
    t = weights(pred, rename=rename) + [("ctx", ctx), ("masks_x", masks_x), ("masks", masks)]
    t += both(case, "out", out32, out64)
    save(case, t, dict(cfg(VJ_PRED), calls={"out": "forward(ctx, None, [masks_x], [masks[0]], mask_index=0)"}),
         SOURCE["vjepa"] + " src/models/predictor.py:VisionTransformerPredictor",
         {"renamed": "state_dict key mask_tokens.0 stored as w.mask_token (shape [1, 1, predictor_embed_dim])"})


def case_ijepa_loss():
    case = "ijepa_loss"
    torch.manual_seed(5)
    enc0 = ij_vit.VisionTransformer(**IJ_ENC, norm_layer=LN6)
    target = perturb(copy.deepcopy(enc0), 5002).eval()
    encoder = perturb(enc0, 5001).eval()
    torch.manual_seed(6)
    predictor = perturb(ij_vit.VisionTransformerPredictor(**IJ_PRED, norm_layer=LN6), 6001).eval()
    g = torch.Generator().manual_seed(15)
    x = randn([2, 2, 16, 16], g)
    m_enc, p0, p1 = disjoint_masks(2, 16, [7, 4, 4], g)
    masks_enc_t, masks_pred_t = m_enc.unsqueeze(0), torch.stack([p0, p1])
    masks_enc, masks_pred = list(masks_enc_t), list(masks_pred_t)
    apply_masks, repeat_interleave_batch = ij_masks.apply_masks, ij_tensors.repeat_interleave_batch

    def step(enc, pred, tgt, imgs):
        # ijepa src/train.py: forward_target / forward_context / loss_fn
        with torch.no_grad():
            h = tgt(imgs)
            h = F.layer_norm(h, (h.size(-1),))  # default eps 1e-5, no affine
            B = len(h)
            h = apply_masks(h, masks_pred)
            h = repeat_interleave_batch(h, B, repeat=len(masks_enc))
        z = enc(imgs, masks_enc)
        z = pred(z, masks_enc, masks_pred)
        loss_sl1 = F.smooth_l1_loss(z, h)
        # V-JEPA app/vjepa/train.py loss_fn with loss_exp = 1: per mask-pred mean |z - h|^p / p, summed,
        # divided by len(masks_pred). Its z and h are lists (one per mask-pred); ijepa concatenates them
        # mask-major with B rows each, so chunk back.
        loss_exp, loss_l1 = 1.0, 0.0
        for zi, hi in zip(z.split(B), h.split(B)):
            loss_l1 = loss_l1 + torch.mean(torch.abs(zi - hi) ** loss_exp) / loss_exp
        loss_l1 = loss_l1 / len(masks_pred)
        loss_mse = F.mse_loss(z, h)
        # the V-JEPA form equals the plain mean |z - h| here (equal-sized chunks)
        plain = (z - h).abs().mean()
        assert abs(loss_l1.item() - plain.item()) <= (1e-12 if z.dtype == torch.float64 else 1e-6) * max(1.0, plain.item()), (loss_l1, plain)
        return loss_sl1, loss_l1, loss_mse

    with torch.no_grad():
        l32 = step(encoder, predictor, target, x)
    enc64, pred64, tgt64 = (copy.deepcopy(m).double() for m in (encoder, predictor, target))
    l64 = step(enc64, pred64, tgt64, x.double())
    l64[0].backward()
    for a, b in zip(l64, l32):
        assert a.dim() == 0 and b.dim() == 0

    t = weights(encoder, "w.encoder.") + weights(predictor, "w.predictor.") + weights(target, "w.target.")
    t += [("x", x), ("masks_enc", masks_enc_t), ("masks_pred", masks_pred_t)]
    for name, a, b in zip(["loss_smooth_l1", "loss_l1", "loss_mse"], l32, l64):
        t += both(case, name, a, b)
    for prefix, m in (("grad.encoder.", enc64), ("grad.predictor.", pred64)):
        for k, p in m.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, k
                t.append((prefix + k, p.grad.detach().clone()))
    config = {"encoder": cfg(IJ_ENC), "predictor": cfg(IJ_PRED), "target": "encoder config, separately perturbed copy",
              "nenc": 1, "npred": 2,
              "steps": ["h = target(x); h = F.layer_norm(h, (D,)) (eps 1e-5)",
                        "h = apply_masks(h, masks_pred); h = repeat_interleave_batch(h, B, repeat=len(masks_enc))",
                        "z = predictor(encoder(x, masks_enc), masks_enc, masks_pred)",
                        "loss_smooth_l1 = F.smooth_l1_loss(z, h) (beta 1, mean)",
                        "loss_l1 = sum_m mean(|z_m - h_m|) / M (V-JEPA loss_fn, loss_exp 1)",
                        "loss_mse = F.mse_loss(z, h)"],
              "grads": "d loss_smooth_l1 / d param, float64 only, trainable params of encoder and predictor"}
    save(case, t, config,
         SOURCE["ijepa"] + " src/models/vision_transformer.py:VisionTransformer,VisionTransformerPredictor; "
         "src/masks/utils.py:apply_masks; src/utils/tensors.py:repeat_interleave_batch; src/train.py loss; "
         + SOURCE["vjepa"] + " app/vjepa/train.py:loss_fn",
         {"scalars": "loss_* are 0-d tensors (shape [])",
          "masks": "masks_enc[i] and masks_pred[j] are the list entries passed to the reference"})


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    print("ijepa:", SOURCE["ijepa"], IJEPA_PATH)
    print("vjepa:", SOURCE["vjepa"], VJEPA_PATH)
    print("attention:", SDPA_NOTE)
    case_ijepa_encoder()
    case_ijepa_predictor()
    case_vjepa_encoder()
    case_vjepa_predictor()
    case_ijepa_loss()
    print("max |f32 - f64| per output:")
    for case, name, d in DIFFS:
        print(f"  {case:16s} {name:16s} {d:.3e}")


if __name__ == "__main__":
    main()
