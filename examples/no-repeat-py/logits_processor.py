"""Example logits processor in Python (componentize-py): bans the row's previous token, so the
same token never appears twice in a row. componentize-py looks up the exported interface
`logits-processor` as this module and its resource `session` as the class `Session`.
Build: examples/build.sh (see examples/README.md)."""

from wit_world.exports import logits_processor
from wit_world.imports import tensors, types


class Session(logits_processor.Session):
    """Per-request, per-row state (none needed)."""

    @classmethod
    def create(cls, params: types.SamplingParams) -> "Session":
        return cls()

    def process(self, logits: tensors.Logits, history: tensors.History, step: int) -> None:
        n = history.len()
        if n > 0:
            logits.ban(history.read(n - 1, n))

    def accept(self, token: int, raw_logprob: float, sampled_logprob: float) -> None:
        pass
