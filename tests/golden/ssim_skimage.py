"""SSIM goldens from scikit-image's structural_similarity (Debian's python3-skimage), the reference the
SSIM test compares with. Not run by CI; rerun by hand:  /usr/bin/python3 tests/golden/ssim_skimage.py

The images are closed-form (no random draws), so the C++ test builds the same pixels: for pair k,
  a[c, y, x] = sin(0.31 x + 0.17 y + c) * cos(0.05 x y / (k + 1))
  b[c, y, x] = 0.8 a + 0.15 cos(0.7 x - 0.4 y + 2 c + k) - 0.05
on a 3 x 20 x 24 grid (values in about [-1, 1]; data range 2). Gaussian window sigma 1.5 truncated at 3.5
sigma (11 x 11), K1 0.01, K2 0.03, population covariances, the mean over windows that fit (skimage crops
5 pixels at each border), averaged over channels.
"""
import numpy as np
from skimage.metrics import structural_similarity

C, H, W = 3, 20, 24
y, x = np.meshgrid(np.arange(H, dtype=np.float64), np.arange(W, dtype=np.float64), indexing="ij")
for k in range(3):
    a = np.stack([np.sin(0.31 * x + 0.17 * y + c) * np.cos(0.05 * x * y / (k + 1)) for c in range(C)])
    b = np.stack([0.8 * a[c] + 0.15 * np.cos(0.7 * x - 0.4 * y + 2 * c + k) - 0.05 for c in range(C)])
    s = structural_similarity(a, b, channel_axis=0, data_range=2.0, gaussian_weights=True, sigma=1.5,
                              use_sample_covariance=False, K1=0.01, K2=0.03)
    print(f"pair {k}: ssim {s:.17g}")
