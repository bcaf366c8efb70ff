"""Redraws the README's two pictures.

    pip install -e '.[docs]'; apt-get install chromium   # tensorboard, a headless browser
    python scripts/make_images.py [--only schedule|tensorboard]

* docs/images/tensorboard.png: trains configs/default.yaml for a few steps on CPU (held-out
  loss every 10 steps) into a temporary run dir, serves it with `tensorboard --logdir` on
  loopback, and screenshots the scalars page (loss, eval loss, lr, tokens/s) with headless Chromium.
* docs/images/schedule_zbv.png: `pipeline.plot.plot_schedule` of the paired ZB-V table
  (p = 4, m = 8) drawn at per-action tick costs, the lockstep executor's timeline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(REPO, "docs", "images")
# Per-action tick times (ms) of the paired table: F, B, W as `bench/pipeline.py` measures them.
COSTS = {"F": 15.2, "B": 18.8, "W": 18.6}
TRAIN_STEPS = 120


def schedule_png(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, REPO)
    from jax_overlap.pipeline.plot import plot_schedule
    from jax_overlap.pipeline.schedules import zb_v

    s = zb_v(4, 8, paired=True)
    ax = plot_schedule(s, cost=COSTS)
    ax.set_title(f"ZB-V, 4 stages x 2 chunks, 8 microbatches, paired F+B ticks, "
                 f"at F/B/W = {COSTS['F']}/{COSTS['B']}/{COSTS['W']} ms")
    ax.figure.set_size_inches(14, 3.6)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=130)
    plt.close(ax.figure)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    raise SystemExit("error: no chromium on PATH; install it (apt-get install chromium)")


def _wait_until_serving(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: tensorboard exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "data/runs", timeout=2) as r:
                if r.status == 200 and b"[" in r.read():
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"error: tensorboard did not serve {url} within {timeout_s:.0f} s")


def tensorboard_png(path: str) -> None:
    browser = _browser()
    tensorboard = shutil.which("tensorboard") or os.path.join(os.path.dirname(sys.executable),
                                                              "tensorboard")
    if not os.path.exists(tensorboard):
        raise SystemExit("error: no tensorboard; pip install -e '.[docs]'")
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "default")
        env = {**os.environ, "PYTHONPATH": REPO}
        subprocess.run([sys.executable, "-m", "jax_overlap.cli", "train",
                        "--config", os.path.join(REPO, "configs", "default.yaml"),
                        "--run-dir", run, "--no-progress",
                        "--set", f"train.steps={TRAIN_STEPS}", "--set", "train.eval_every=10",
                        "--set", "checkpoint.every_steps=0"], check=True, env=env, cwd=tmp)
        port = _free_port()
        url = f"http://127.0.0.1:{port}/"
        server = subprocess.Popen([tensorboard, "--logdir", tmp, "--host", "127.0.0.1",
                                   "--port", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            _wait_until_serving(url, server)
            # The scalars dashboard (SVG charts, drawn without a GPU), filtered to the four
            # charts the README names: train and eval loss, lr, tokens/s.
            page = url + "#scalars&tagFilter=loss%7Clr%7Ctokens_per_s"
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", "--window-size=1400,800",
                            "--virtual-time-budget=20000", f"--screenshot={path}", page],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=180)
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["schedule", "tensorboard"])
    only = ap.parse_args().only
    os.makedirs(IMAGES, exist_ok=True)
    if only in (None, "schedule"):
        schedule_png(os.path.join(IMAGES, "schedule_zbv.png"))
    if only in (None, "tensorboard"):
        tensorboard_png(os.path.join(IMAGES, "tensorboard.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
