"""The one error every layer may raise about the user's settings. It sits at the bottom of the
package (no imports) so that low layers (the mesh, the data readers) raise it without importing
the config; `jax_overlap.config` re-exports it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot work; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
