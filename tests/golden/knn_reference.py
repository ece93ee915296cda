"""kNN golden from DINO's own weighted k-NN classifier (facebookresearch/dino, eval_knn.py `knn_classifier`),
run under the project's environment (requirements.txt: torch 2.13.0, torchvision 0.28.0, safetensors 0.8.0) on
CPU on a small fixed random problem. Not run by CI; rerun by hand:

    .venv/bin/python tests/golden/knn_reference.py

`knn_classifier` is imported from a checkout of the repository, never from a copy in this project: DINO_SRC
names the checkout; when unset, the script exports eval_knn.py, utils.py and vision_transformer.py of HEAD of the bare mirror (DINO_MIRROR, default
/work/.mirror/facebookresearch+dino/repo) into /tmp/dino_src. eval_knn.py imports torchvision at module level for its
feature-extraction pipeline; the installed torchvision serves it (knn_classifier does not use it). DINO is not a
pip package, so the checkout stays; nothing is stubbed.

The features are L2-normalised with nn.functional.normalize(dim=1, p=2), as eval_knn.py's __main__ does
before it calls knn_classifier(train_features, train_labels, test_features, test_labels, k, T).

knn_classifier returns only top-1 / top-5 percentages. The per-item predictions come from the same function:
item i replicated 100 times (its chunking needs >= 100 test rows) with every label set to c scores top-1
100 exactly when its prediction is c. The sum of the per-item hits is checked against the whole-set call.

Output: tests/golden/knn/dino_knn.safetensors (write_st of tests/golden/st_io.py, the safetensors package):
  train_x F32 [N, D], train_y I64 [N], test_x F32 [M, D], test_y I64 [M]   (raw features, before normalising)
  for each case CASE (see CASES): CASE.pred I64 [M] (DINO's top-1 class per item), CASE.correct I64 [] (hits)
  __metadata__: source (repo@commit), torch, cases (JSON: name, k, T, top1 percent, correct), notes.
"""
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "knn", "dino_knn.safetensors")
MIRROR = os.environ.get("DINO_MIRROR", "/work/.mirror/facebookresearch+dino/repo")
sys.path.insert(0, HERE)
from st_io import VERSION as ST_VERSION, read_st, write_st  # noqa: E402


def _checkout():
    commit = subprocess.check_output(["git", "-C", MIRROR, "rev-parse", "HEAD"], text=True).strip()
    src = os.environ.get("DINO_SRC")
    if not src:
        src = "/tmp/dino_src"
        if not os.path.isfile(os.path.join(src, "eval_knn.py")):
            os.makedirs(src, exist_ok=True)
            # only the modules eval_knn.py imports: the mirror may lack the large binary blobs (.github/*.png)
            archive = subprocess.Popen(["git", "-C", MIRROR, "archive", "HEAD", "--", "eval_knn.py", "utils.py",
                                        "vision_transformer.py"], stdout=subprocess.PIPE)
            subprocess.check_call(["tar", "-x", "-C", src], stdin=archive.stdout)
            assert archive.wait() == 0
    return os.path.abspath(src), commit


import torchvision  # noqa: E402  (eval_knn.py imports it at module level; installed, requirements.txt)

DINO_PATH, DINO_COMMIT = _checkout()
sys.path.insert(0, DINO_PATH)
import eval_knn  # noqa: E402
assert os.path.abspath(eval_knn.__file__).startswith(DINO_PATH), eval_knn.__file__

N, M, D, C = 400, 200, 16, 5
# (name, k, T): DINO's defaults (k = 20 of nb_knn, T = 0.07), and a sharper vote over more neighbours.
CASES = [("k20_t0.07", 20, 0.07), ("k50_t0.02", 50, 0.02)]


def make_problem():
    g = torch.Generator().manual_seed(17)
    means = torch.randn(C, D, generator=g) * 0.6
    def draw(n):
        y = torch.randint(0, C, (n,), generator=g)
        # class clusters of unequal spread plus a shared offset, so that cosine and the votes are not trivial
        spread = 0.6 + 0.2 * y.to(torch.float32).unsqueeze(1)
        x = means[y] + spread * torch.randn(n, D, generator=g) + 0.5
        return x.to(torch.float32), y.to(torch.int64)
    xtr, ytr = draw(N)
    xte, yte = draw(M)
    return xtr, ytr, xte, yte


def main():
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = make_problem()
    ntr = nn.functional.normalize(xtr, dim=1, p=2)
    nte = nn.functional.normalize(xte, dim=1, p=2)
    tensors = {"train_x": xtr, "train_y": ytr, "test_x": xte, "test_y": yte}
    cases = []
    for name, k, T in CASES:
        top1, _ = eval_knn.knn_classifier(ntr, ytr, nte, yte, k, T, num_classes=C)
        pred = torch.full((M,), -1, dtype=torch.int64)
        for i in range(M):
            q = nte[i:i + 1].expand(100, D).contiguous()
            for c in range(C):
                t1, _ = eval_knn.knn_classifier(ntr, ytr, q, torch.full((100,), c, dtype=torch.int64), k, T,
                                                num_classes=C)
                assert t1 in (0.0, 100.0), t1
                if t1 == 100.0:
                    pred[i] = c
                    break
            assert pred[i] >= 0, i
        correct = int(pred.eq(yte).sum())
        assert abs(correct * 100.0 / M - top1) < 1e-9, (correct, top1)
        # Diagnostics only (not the reference): how far the problem is from ties, in float64.
        sim = (ntr.double() @ nte.double().t()).t()
        s, idx = sim.topk(k + 1, 1)
        gap = (s[:, k - 1] - s[:, k]).min().item()
        w = torch.zeros(M, C, dtype=torch.float64).scatter_add_(1, ytr[idx[:, :k]], (s[:, :k] / T).exp())
        ws = w.sort(1, descending=True)[0]
        vote_gap = ((ws[:, 0] - ws[:, 1]) / ws[:, 0]).min().item()
        counts = torch.zeros(M, C, dtype=torch.float64).scatter_add_(1, ytr[idx[:, :k]], torch.ones(M, k,
                                                                                                   dtype=torch.float64))
        count_max = counts.max(1, keepdim=True)[0]
        unique_majority = counts.eq(count_max).sum(1).eq(1)
        differ = (unique_majority & counts.argmax(1).ne(pred)).sum().item()
        cases.append({"name": name, "k": k, "T": T, "top1_percent": top1, "correct": correct, "test_items": M,
                      "min_kth_similarity_gap": gap, "min_relative_vote_gap": vote_gap,
                      "items_where_a_unique_majority_class_differs": differ})
        tensors[name + ".pred"] = pred
        tensors[name + ".correct"] = torch.tensor(correct, dtype=torch.int64)
        print(cases[-1])
    meta = {
        "source": f"facebookresearch/dino@{DINO_COMMIT} eval_knn.py knn_classifier",
        "torch": torch.__version__,
        "versions": json.dumps({"torch": torch.__version__, "torchvision": torchvision.__version__,
                                "safetensors": ST_VERSION}, sort_keys=True),
        "cases": json.dumps(cases),
        "notes": "features L2-normalised by nn.functional.normalize before knn_classifier, as eval_knn.py does; "
                 "per-item predictions by calling knn_classifier on 100 copies of the item labelled c",
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    write_st(OUT, tensors, meta)
    back, meta_back = read_st(OUT)
    assert meta_back == meta and all(torch.equal(back[k], v) for k, v in tensors.items())
    print("wrote", OUT)


if __name__ == "__main__":
    main()
