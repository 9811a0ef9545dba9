"""What a training step asks of the store, as the planner needs it: the groups in the order the step
touches them, each group's compute, the activations a pass keeps on the GPU, the tokens of a step.

The store knows nothing of models: the trainer builds a ``Workload`` (``trainer.planning.plan_workload``), timing one
layer on the GPU when there is one; the planner and the cost model read only these figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tiermem.specs import Group

# boundary activations a pass holds on the GPU beyond those that live there, when some live in the host tier: the
# one written out (its layer reads it while the copy runs) and the one read back ahead of its layer's backward
HOST_WINDOW = 2


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
    kept_bytes: int = 0  # what one layer's forward graph keeps for one micro-batch (tiermem_keep_activations)
    embed_grad_bytes: int = 0  # of working_bytes: the embedding's fp32 gradient, summed in its home when in HBM
    # the rows of a micro-batch these figures are for, and of working_bytes what a layer's forward + backward
    # of one micro-batch takes (it grows with the micro-batch's tokens) and what the loss's takes (the larger of
    # the two is in working_bytes): what ``in_pieces`` scales. 0: not known (nothing is scaled)
    micro_rows: int = 0
    layer_work_bytes: int = 0
    head_work_bytes: int = 0
    # attention's FLOPs a token (causal, tiermem.plan.flops), for TFLOP/s counted with it beside 6·N. 0: not known
    attention_flops_per_token: float = 0.0
    # the share of a layer's forward that a kept layer's backward does not run again: 1, the whole recompute; a row
    # cut into chunks keeps its attention's graph alone, and skips only q/k/v and the attention's forward
    kept_saves: float = 1.0
    # seconds a decoder layer's backward costs each piece (micro-batch) it computes, whatever the piece's tokens (its
    # gradient added into the fp32 sum: ``Machine.gpu_piece_rate``): in ``bwd`` already, and what ``in_pieces`` adds
    # for each further piece. 0: not known
    piece_seconds: float = 0.0

    @property
    def groups(self) -> list[Group]:
        """Every group in the order the optimizer updates them (the next forward's order)."""
        return [self.first, *self.layers, self.last]

    def compute_seconds(self) -> float:
        return sum(self.fwd.values()) + sum(self.bwd.values())

    def activation_bytes(self, passes: int, micro_tokens: int | None = None, embed_home: bool = False) -> int:
        """GPU memory for activations when a step runs as ``passes`` layer-major passes (``embed_home``: the
        embedding's gradient is summed in its home in HBM, no tensor of its own)."""
        per_pass = -(-self.micro_batches // passes) * (micro_tokens or self.tokens // max(self.micro_batches, 1))
        return per_pass * self.boundary_bytes_per_token + self.working_bytes \
            - (self.embed_grad_bytes if embed_home else 0)

    def layer_boundary_bytes(self, passes: int, micro_tokens: int | None = None) -> int:
        """One boundary activation (a layer's input) of a pass's micro-batches: the unit placed off the GPU."""
        per_pass = -(-self.micro_batches // passes) * (micro_tokens or self.tokens // max(self.micro_batches, 1))
        return per_pass * self.boundary_bytes_per_token // (len(self.layers) + 1)

    def hbm_activation_bytes(self, passes: int, host: int, embed_home: bool = False) -> int:
        """GPU memory for activations when the boundaries 0..``host``-1 (layer i's input) live in the host tier:
        the others, ``HOST_WINDOW`` boundaries in flight (one going out, one coming back), and the working set."""
        if not host:
            return self.activation_bytes(passes, embed_home=embed_home)
        one = self.layer_boundary_bytes(passes)
        return self.activation_bytes(passes, embed_home=embed_home) - (host - HOST_WINDOW) * one

    def scaled(self, tokens: int, micro_batches: int) -> Workload:
        """The same model at another number of tokens a step (compute scales with tokens; a micro-batch's working
        set is taken as it is)."""
        f = tokens / self.tokens
        per_micro = (tokens / max(micro_batches, 1)) / (self.tokens / max(self.micro_batches, 1))
        return replace(self, fwd={g: s * f for g, s in self.fwd.items()}, bwd={g: s * f for g, s in self.bwd.items()},
                       tokens=tokens, micro_batches=micro_batches, notes=list(self.notes),
                       kept_bytes=int(self.kept_bytes * per_micro))  # (a kept graph grows with a micro-batch's tokens)

    def in_pieces(self, rows: int) -> Workload:
        """The same step with each micro-batch of ``micro_rows`` rows computed as pieces of at most ``rows`` rows
        (``trainer.run.pieces``): more, smaller micro-batches, the same tokens and FLOPs, each layer's cost a piece
        (``piece_seconds``) for each further piece; a layer's working set and a kept graph shrink with a piece's rows
        (the loss's does not: its logits are chunked anyway). ``rows`` at least twice ``micro_rows``: pieces of
        ``rows // micro_rows`` consecutive micro-batches merged (fewer, larger pieces: a layer's cost a piece the
        fewer, its working set and a kept graph larger)."""
        if not self.micro_rows or rows == self.micro_rows or self.micro_rows < rows < 2 * self.micro_rows:
            return self
        if rows > self.micro_rows:
            n = -(-self.micro_batches // (rows // self.micro_rows))  # (pieces a step)
        else:
            n = self.micro_batches * -(-self.micro_rows // rows)
        f = rows / self.micro_rows
        layer = int(self.layer_work_bytes * f)
        working = self.working_bytes - max(self.layer_work_bytes, self.head_work_bytes) \
            + max(layer, self.head_work_bytes)
        more = (n - self.micro_batches) * self.piece_seconds  # (each layer's cost of the further, or fewer, pieces)
        bwd = {g: s + more if g in self.layers else s for g, s in self.bwd.items()}
        return replace(self, micro_batches=n, working_bytes=working, bwd=bwd,
                       kept_bytes=int(self.kept_bytes * f), micro_rows=rows, layer_work_bytes=layer,
                       notes=list(self.notes))

    def to_json(self) -> dict:
        out = asdict(self)
        out["fwd"] = {str(k): v for k, v in self.fwd.items()}
        out["bwd"] = {str(k): v for k, v in self.bwd.items()}
        return out

    @classmethod
    def from_json(cls, o) -> Workload:
        """The workload ``to_json`` wrote (a trainer's, sent to the service); ValueError naming what is wrong."""
        if not isinstance(o, dict):
            raise ValueError("the workload must be an object")
        layers = o.get("layers")
        if not (isinstance(layers, list) and 0 < len(layers) <= 10_000
                and all(isinstance(g, int) and not isinstance(g, bool) for g in layers)):
            raise ValueError("workload.layers must be a list of layer numbers")
        first, last = o.get("first"), o.get("last")
        if not (isinstance(first, str) and isinstance(last, str)):
            raise ValueError("workload.first and workload.last must name groups")
        groups = {str(g): g for g in [first, *layers, last]}

        def seconds(name: str) -> dict:
            d = o.get(name)
            if not (isinstance(d, dict) and set(d) == set(groups)):
                raise ValueError(f"workload.{name} must give seconds for every group")
            out = {}
            for k, v in d.items():
                if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6):
                    raise ValueError(f"workload.{name}[{k!r}] must be seconds")
                out[groups[k]] = float(v)
            return out

        def number(name: str, lo: float, hi: float, integral: bool = True):
            v = o.get(name)
            if not (isinstance(v, int if integral else (int, float)) and not isinstance(v, bool) and lo <= v <= hi):
                raise ValueError(f"workload.{name} must be a number in [{lo:g}, {hi:g}]")
            return v

        tied, timed = o.get("tied", False), o.get("timed", "estimated")
        if not isinstance(tied, bool) or not isinstance(timed, str):
            raise ValueError("workload.tied must be true or false, workload.timed a string")
        return cls(list(layers), first, last, seconds("fwd"), seconds("bwd"), number("tokens", 1, 1 << 40),
                   number("micro_batches", 1, 4096), number("boundary_bytes_per_token", 0, 1 << 40),
                   number("working_bytes", 0, 1 << 50), float(number("flops_per_token", 0, 1e18, False)), tied,
                   timed[:200], [], number("kept_bytes", 0, 1 << 50) if "kept_bytes" in o else 0,
                   number("embed_grad_bytes", 0, o.get("working_bytes", 0)) if "embed_grad_bytes" in o else 0,
                   *(number(k, 0, 1 << 50) if k in o else 0
                     for k in ("micro_rows", "layer_work_bytes", "head_work_bytes")),
                   float(number("attention_flops_per_token", 0, 1e18, False)) if "attention_flops_per_token" in o
                   else 0.0, float(number("kept_saves", 0, 1, False)) if "kept_saves" in o else 1.0,
                   float(number("piece_seconds", 0, 1e6, False)) if "piece_seconds" in o else 0.0)
