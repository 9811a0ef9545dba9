"""What a training step asks of the store, as the planner needs it: the groups in the order the step
touches them, each group's compute, the activations a pass keeps on the GPU, the tokens of a step.

The store knows nothing of models: the trainer builds a ``Workload`` (``trainer.plan_workload``), timing one
layer on the GPU when there is one; the planner and the cost model read only these figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tiermem.store.catalog import Group


@dataclass
class Workload:
    layers: list[Group]  # the streamed decoder layers in forward order
    first: Group  # the group the forward starts with (the embedding)
    last: Group  # the group the loss runs with (final norm + LM head)
    fwd: dict  # group -> seconds of its forward over all of a step's tokens
    bwd: dict  # group -> seconds of its backward over all of a step's tokens (with recompute)
    tokens: int  # tokens a step
    micro_batches: int
    boundary_bytes_per_token: int  # the boundary activations a pass keeps, per token of the pass
    working_bytes: int  # the GPU memory a micro-batch's layer forward + backward needs on top of them
    flops_per_token: float  # 6·N, for TFLOP/s as everyone counts it
    tied: bool = False  # the loss also reads ``first``'s weights (a tied LM head)
    timed: str = "estimated"  # how the compute figures were had: "timed on <device>" or "estimated ..."
    notes: list[str] = field(default_factory=list)

    @property
    def groups(self) -> list[Group]:
        """Every group in the order the optimizer updates them (the next forward's order)."""
        return [self.first, *self.layers, self.last]

    def compute_seconds(self) -> float:
        return sum(self.fwd.values()) + sum(self.bwd.values())

    def activation_bytes(self, passes: int, micro_tokens: int | None = None) -> int:
        """GPU memory for activations when a step runs as ``passes`` layer-major passes."""
        per_pass = -(-self.micro_batches // passes) * (micro_tokens or self.tokens // max(self.micro_batches, 1))
        return per_pass * self.boundary_bytes_per_token + self.working_bytes

    def scaled(self, tokens: int, micro_batches: int) -> Workload:
        """The same model at another number of tokens a step (compute scales with tokens)."""
        f = tokens / self.tokens
        return Workload(self.layers, self.first, self.last, {g: s * f for g, s in self.fwd.items()},
                        {g: s * f for g, s in self.bwd.items()}, tokens, micro_batches, self.boundary_bytes_per_token,
                        self.working_bytes, self.flops_per_token, self.tied, self.timed, list(self.notes))

    def to_json(self) -> dict:
        out = asdict(self)
        out["fwd"] = {str(k): v for k, v in self.fwd.items()}
        out["bwd"] = {str(k): v for k, v in self.bwd.items()}
        return out
