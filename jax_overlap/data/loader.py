"""Grain over the token shards (`data.source: tokens`): batch `i` is a pure function of
(seed, i), each process reads only its own rows, and reading runs ahead in threads.

Windows: the split's tokens are cut into `seq_len + 1`-token windows starting every `seq_len`
tokens (each token is a target once per epoch). Global sample `g` (batch `g // B`, row
`g % B`) is window `order[g]`, where `order` is Grain's seeded `shuffle` over the windows,
repeated: every epoch is a fresh permutation (Grain folds the epoch into the seed), and the
position in the stream is the batch index alone. That index is the Grain iterator's state
(`next_index`), and the train state already checkpoints it (`TrainState.step +
data_offset`), so a restored run reads exactly the next batch, and a rollback's skip is a jump
of the index.

Per-process rows: a process holds the batch rows its devices own under the batch sharding
(`P(DP)`); it reads those windows and no others, and `place` assembles the global array from
the processes' parts (`jax.make_array_from_callback`).

Prefetch: a `grain.MapDataset` of local batches from the current index, turned into an
iterator with `ReadOptions(num_threads, prefetch_buffer_size)`; its threads read the next
batches while the step runs. Asking for another index than the next one (resume, rollback,
evaluation) starts a new iterator there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_overlap.data import shards as shardlib
from jax_overlap.data import tokenizer as toklib

_NO_END = 1 << 62  # the batch dataset is "infinite": the shuffled window order repeats


class TokenLoader:
    """Batches of token windows of one split of a prepare-data directory.

    Args:
      directory: the prepare-data output (`data.path`).
      seq_len: tokens per example (`model.seq_len`).
      global_batch: rows per batch over all processes (`train.global_batch`).
      seed: the shuffle seed (`train.seed`).
      split: `train` or `val`.
      shuffle: False reads the windows in order (evaluation).
      threads, prefetch: Grain's reader threads and batches read ahead.
    """

    def __init__(self, directory: str, seq_len: int, global_batch: int, seed: int,
                 split: str = "train", shuffle: bool = True, threads: int = 2,
                 prefetch: int = 4):
        import grain

        index = toklib.read_index(directory)
        self.index = index
        self.tokens = shardlib.TokenArray(directory, index)
        sp = index["split"]
        self.start, stop = ((0, sp["train_tokens"]) if split == "train" else
                            (sp["val_start"], sp["val_start"] + sp["val_tokens"]))
        self.seq_len, self.global_batch, self.split, self.seed = seq_len, global_batch, split, seed
        self.num_windows = (stop - self.start - 1) // seq_len
        if self.num_windows < 1:
            fix = ("prepare-data with a larger --val-fraction or more input" if split == "val"
                   else "prepare more data")
            raise ValueError(f"data.path: {directory}: the {split} split has "
                             f"{stop - self.start} tokens, fewer than model.seq_len + 1 = "
                             f"{seq_len + 1}; {fix}, or lower model.seq_len")
        order = grain.MapDataset.range(self.num_windows)
        if shuffle:
            order = order.shuffle(seed=seed % (1 << 32))
        self._order = order.repeat()
        self._read_options = grain.ReadOptions(num_threads=threads,
                                               prefetch_buffer_size=prefetch)
        self._iter: Any = None
        self._iter_rows: tuple[int, ...] | None = None
        self._next = -1

    # ---- what batch i holds ---------------------------------------------------------------

    def window_ids(self, index: int, rows) -> np.ndarray:
        """The windows of batch `index`'s `rows` (global row numbers)."""
        base = index * self.global_batch
        return np.asarray([self._order[base + int(r)] for r in rows], np.int64)

    def read_rows(self, index: int, rows) -> dict[str, np.ndarray]:
        """Rows `rows` of batch `index`: {"inputs", "targets"} int32 of (len(rows), seq_len)."""
        t = self.seq_len
        windows = self.tokens.read_many(self.start + self.window_ids(index, rows) * t, t + 1)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """The whole global batch `index` (every row; for one process or inspection)."""
        return self.read_rows(index, range(self.global_batch))

    # ---- prefetching reads of this process's rows -----------------------------------------

    def local_batch(self, index: int, rows) -> dict[str, np.ndarray]:
        """Batch `index`'s `rows`, from the prefetching Grain iterator (restarted at `index`
        unless `index` is the batch it reads next)."""
        rows = tuple(int(r) for r in rows)
        if self._iter is None or index != self._next or rows != self._iter_rows:
            self.close()
            self._iter = iter(self._batches(index, rows).to_iter_dataset(self._read_options))
            self._iter_rows = rows
        out = next(self._iter)
        self._next = index + 1
        return out

    def close(self) -> None:
        """Stops the reader threads (a later read starts new ones)."""
        if self._iter is not None and hasattr(self._iter, "close"):
            self._iter.close()
        self._iter = None

    def iterator_state(self) -> dict[str, int]:
        """The Grain iterator's position as a batch index (what the train state saves)."""
        return {"next_batch": self._next}

    def _batches(self, start: int, rows: tuple[int, ...]):
        import grain

        return grain.MapDataset.range(start, _NO_END).map(lambda i: self.read_rows(i, rows))

    def place(self, index: int, mesh) -> dict:
        """Batch `index` as global arrays on `mesh`, split over dp; this process reads only
        the rows its devices hold."""
        rows = process_rows(mesh, self.global_batch)
        return put_rows(self.local_batch(index, rows), rows, self.global_batch, mesh)


def process_rows(mesh, global_batch: int) -> np.ndarray:
    """The global batch rows this process's devices hold under the batch sharding P(DP)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.mesh import DP

    sharding = NamedSharding(mesh, P(DP))
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows.update(range(*idx[0].indices(global_batch)))
    return np.asarray(sorted(rows), np.int64)


def put_rows(local: dict[str, np.ndarray], rows, global_batch: int, mesh) -> dict:
    """Global arrays of `global_batch` rows from this process's `rows` of them (`local[k][i]`
    is global row `rows[i]`), split over dp."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_overlap.parallel.mesh import DP

    sharding = NamedSharding(mesh, P(DP))
    where = {int(r): i for i, r in enumerate(rows)}

    def part(value):
        def cb(idx):
            lo, hi, _ = idx[0].indices(global_batch)
            return value[(slice(where[lo], where[lo] + hi - lo), *idx[1:])]
        return cb

    return {k: jax.make_array_from_callback((global_batch, *v.shape[1:]), sharding, part(v))
            for k, v in local.items()}
