"""Image classification data addressed by batch index: a synthetic task and the user's files.

Like `jax_overlap.data.streams.TokenStream`, a batch is a pure function of (seed, batch index), built
whole on every process before it is split over dp: every mesh sees exactly the same global
batch, and a resumed run regenerates the batches an uninterrupted one would have seen.

Batches are `{'inputs': float32 (B, H, W, C), 'targets': int32 (B,)}`.

Sources:
  * `SyntheticImages`: oriented sinusoidal gratings; the class is the orientation (classes
    evenly spaced over 180 degrees). Phase, frequency, colour, contrast and noise vary per
    image, so a model must learn an orientation detector: with a few classes a small ResNet
    learns it in a few dozen steps (configs/resnet_tiny.yaml); with hundreds of classes the
    orientations are fractions of a degree apart and the task serves throughput runs.
  * `ArrayImages` over `load_images(path)`: a `.npz` (arrays `images` and `labels`), a `.npy`
    of images with its labels in `<name>_labels.npy` next to it, or an image folder laid out
    `root/<class name>/<image file>` (classes sorted by name), resized to the model's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=[seed, index]))


@dataclass(frozen=True)
class SyntheticImages:
    """Gratings whose orientation (one of `classes`, evenly spaced over 180 deg) is the label."""

    image_size: int
    classes: int
    global_batch: int
    seed: int
    channels: int = 3
    noise: float = 0.5

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """Batch `index`: images (B, S, S, C) float32 of roughly unit scale, labels (B,)."""
        rng = _rng(self.seed, index)
        b, s, c = self.global_batch, self.image_size, self.channels
        labels_b = rng.integers(0, self.classes, size=b)
        # Orientation per class plus a little jitter (a quarter of the class spacing).
        theta_b = (labels_b + rng.uniform(-0.25, 0.25, b)) * np.pi / self.classes
        cycles_b = rng.uniform(1.5, 4.0, b)  # spatial frequency: cycles across the image
        phase_b = rng.uniform(0, 2 * np.pi, b)
        contrast_b = rng.uniform(0.5, 1.5, b)
        colour_bc = rng.uniform(0.2, 1.0, (b, c))
        coords_s = (np.arange(s) + 0.5) / s - 0.5
        yy_ss, xx_ss = np.meshgrid(coords_s, coords_s, indexing="ij")
        # Distance along each image's wave direction, (B, S, S).
        along_bss = (np.cos(theta_b)[:, None, None] * xx_ss
                     + np.sin(theta_b)[:, None, None] * yy_ss)
        wave_bss = np.sin(2 * np.pi * cycles_b[:, None, None] * along_bss
                          + phase_b[:, None, None])
        images_bssc = (contrast_b[:, None, None, None] * wave_bss[..., None]
                       * colour_bc[:, None, None, :])
        images_bssc = images_bssc + self.noise * rng.standard_normal((b, s, s, c))
        return {"inputs": images_bssc.astype(np.float32), "targets": labels_b.astype(np.int32)}


@dataclass(frozen=True)
class ArrayImages:
    """A labelled image array, visited in a fresh seeded permutation every epoch.

    Attributes:
      images: (N, H, W, C) float32, already normalised.
      labels: (N,) int.
      global_batch, seed: as for `TokenStream`; sample j of the run is position j mod N of
        epoch j // N's permutation.
    """

    images: np.ndarray
    labels: np.ndarray
    global_batch: int
    seed: int

    def batch(self, index: int) -> dict[str, np.ndarray]:
        n = len(self.labels)
        samples = np.arange(index * self.global_batch, (index + 1) * self.global_batch)
        epochs, positions = np.divmod(samples, n)
        rows = np.empty(len(samples), np.int64)
        for epoch in np.unique(epochs):
            perm = _rng(self.seed, int(epoch)).permutation(n)
            here = epochs == epoch
            rows[here] = perm[positions[here]]
        return {"inputs": self.images[rows], "targets": self.labels[rows].astype(np.int32)}


def _as_nhwc(images: np.ndarray, channels: int) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) -> (N, H, W, channels); grey is repeated, alpha dropped."""
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise ValueError(f"images: expected (N, H, W) or (N, H, W, C), got shape {images.shape}")
    if images.shape[-1] == 1 and channels > 1:
        images = np.repeat(images, channels, axis=-1)
    if images.shape[-1] > channels:
        images = images[..., :channels]
    if images.shape[-1] != channels:
        raise ValueError(f"images: {images.shape[-1]} channels, the model takes {channels}")
    return images


def _read_folder(root: str, image_size: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from PIL import Image

    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError(f"data.path: {root} has no class sub-folders; lay it out as "
                         f"{root}/<class name>/<image files>")
    images, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for fname in sorted(os.listdir(folder)):
            if not fname.lower().endswith(IMAGE_SUFFIXES):
                continue
            with Image.open(os.path.join(folder, fname)) as im:
                im = im.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
                images.append(np.asarray(im, np.uint8))
            labels.append(label)
    if not images:
        raise ValueError(f"data.path: no image files ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return np.stack(images), np.asarray(labels), classes


def _read_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    if path.endswith(".npz"):
        with np.load(path) as f:
            keys = set(f.files)
            x_key = next((k for k in ("images", "x") if k in keys), None)
            y_key = next((k for k in ("labels", "y") if k in keys), None)
            if x_key is None or y_key is None:
                raise ValueError(f"data.path: {path} holds {sorted(keys)}; it needs arrays "
                                 f"'images' and 'labels'")
            return f[x_key], f[y_key]
    labels_path = path[: -len(".npy")] + "_labels.npy"
    if not os.path.exists(labels_path):
        raise ValueError(f"data.path: {path} is an image array; put its labels in "
                         f"{labels_path} (or use a .npz with 'images' and 'labels')")
    return np.load(path), np.load(labels_path)


def load_images(path: str, image_size: int, channels: int = 3
                ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Reads a labelled image set and normalises it per channel.

    Args:
      path: a `.npz`, a `.npy` (labels in `<name>_labels.npy`) or an image folder.
      image_size: side the model expects; folders are resized to it, arrays must match it.
      channels: channels the model expects (grey images are repeated).

    Returns:
      (images (N, S, S, C) float32 with zero mean and unit variance per channel,
       labels (N,) int32, class names).

    Raises:
      ValueError: with the fix, for a missing label file, wrong shapes or bad labels.
    """
    if os.path.isdir(path):
        images, labels, names = _read_folder(path, image_size)
    elif path.endswith((".npz", ".npy")):
        images, labels = _read_arrays(path)
        names = [str(i) for i in range(int(labels.max()) + 1)] if len(labels) else []
    else:
        raise ValueError(f"data.path: {path} is neither a .npy/.npz file nor an image folder")
    images = _as_nhwc(np.asarray(images), channels)
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != len(images):
        raise ValueError(f"data.path: {len(images)} images but {len(labels)} labels")
    if images.shape[1:3] != (image_size, image_size):
        raise ValueError(f"data.path: images are {images.shape[1]}x{images.shape[2]}, the model "
                         f"expects {image_size}x{image_size}; resize them or change the model's "
                         f"image size")
    if not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
        raise ValueError("data.path: labels must be non-negative integers")
    # Per-channel standardisation makes the pixel scale (0..255 or 0..1) irrelevant.
    images = images.astype(np.float32)
    mean_c = images.mean(axis=(0, 1, 2))
    std_c = images.std(axis=(0, 1, 2)) + 1e-6
    return ((images - mean_c) / std_c).astype(np.float32), labels.astype(np.int32), names


def image_stream(cfg, image_size: int, classes: int, channels: int = 3):
    """The image source a config asks for: synthetic, or `data.path` with `data.source=file`.

    Args:
      cfg: the run's `Config` (data.source / data.path, train.global_batch / seed).
      image_size, classes, channels: what the model takes and predicts.

    Returns:
      An object with `batch(index) -> {'inputs', 'targets'}`.

    Raises:
      ValueError: for the text source, or a file with more classes than the model predicts.
    """
    d, t = cfg.data, cfg.train
    if d.source == "synthetic":
        return SyntheticImages(image_size, classes, t.global_batch, t.seed, channels)
    if d.source == "file":
        images, labels, _ = load_images(d.path, image_size, channels)
        if labels.max() >= classes:
            raise ValueError(f"data.path: labels go up to {labels.max()}, but the model predicts "
                             f"{classes} classes; raise the number of classes")
        return ArrayImages(images, labels, t.global_batch, t.seed)
    raise ValueError(f"data.source: {d.source!r} is text; image models train on "
                     f"data.source=synthetic or data.source=file with data.path set to a "
                     f".npy/.npz file or an image folder")
