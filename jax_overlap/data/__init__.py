"""Real data in: tokenizers, token shards (`jax-overlap prepare-data`) and the Grain loader
that reads them (`data.source: tokens`). See docs/guides/data_and_hf.md."""
