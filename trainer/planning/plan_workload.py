"""A run's step as the planner sees it (``tiermem.plan.workload.Workload``): the compute of each group and
the activations a pass keeps, for this model at this batch shape.

On a CUDA device one decoder layer and the loss are timed at the run's micro-batch shape (random weights,
a few seconds; the working set measured beside) through the model's stages (the template or the generic
path; a sparse model's heaviest layer); elsewhere the compute is estimated from the FLOPs of the parameters
a token computes with (a sparse layer's top-k experts, at the experts' own rate) and the machine's figures, with each
layer's cost a piece (its gradient summed: ``Machine.gpu_piece_rate``; a sparse layer's experts at
``gpu_expert_piece_rate``), and the memory from the shapes. The trainer corrects the
compute from the first steps.
"""

from __future__ import annotations

import time

import torch

from tiermem.plan.flops import attention_flops_per_token
from tiermem.plan.machine import Machine
from tiermem.plan.workload import Workload
from trainer.model import chunked
from trainer.model.select import model_stages
from trainer.model.weights import all_weights, init_weight
from trainer.planning.flops import attention_layers, flops_per_token
from trainer.run.executor import squared_norm

# a step's compute runs this much longer than the sum of its layers timed alone (measured on the H200 machine:
# 1.05-1.07 for the 3B shape all in HBM, 1.11 for the 8B shape with a CPU AdamW beside it; docs/measurements.md).
# The run corrects its prediction from its first steps (trainer.planning.plan_watch) as well
IN_STEP = 1.08


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def heaviest_layer(cfg) -> int:
    """The layer with the most parameters (a sparse one of a mixture-of-experts model)."""
    sizes: dict = {}
    for w in all_weights(cfg):
        if isinstance(w.group, int):
            sizes[w.group] = sizes.get(w.group, 0) + _numel(w.shape)
    return max(sizes, key=lambda i: (sizes[i], -i)) if sizes else 0


def layer_params(cfg, active: bool = False, layer: int | None = None) -> int:
    """Parameters of decoder layer ``layer`` (None: the heaviest); ``active``: those one token computes with (its
    top-k experts)."""
    return cfg.layer_params(heaviest_layer(cfg) if layer is None else layer, active)


def expert_params(cfg) -> int:
    """The heaviest layer's routed experts' parameters; 0 for a dense model."""
    return cfg.expert_params(heaviest_layer(cfg))


def layer_seconds(cfg, seq: int, layer: int, machine: Machine) -> float:
    """Seconds of layer ``layer``'s forward a token at sequence length ``seq``, estimated: its matmuls at the GPU's
    rate (its routed experts' at theirs: grouped, with the routing's gathers and scatter) and its causal attention (a
    third of its training count, ``trainer.planning.flops``: its own window) at attention's."""
    attention = attention_flops_per_token([attention_layers(cfg)[layer]], seq)
    experts = cfg.expert_params(layer, active=True)
    return (2.0 * (cfg.layer_params(layer, active=True) - experts) / machine.gpu_tflops
            + 2.0 * experts / machine.gpu_expert_tflops + attention / 3 / machine.gpu_attention_tflops
            + routed_width(cfg, layer) / 4 / machine.gpu_expert_route_rate)


def routed_width(cfg, layer: int) -> float:
    """Elements of a token's rows through layer ``layer``'s routed experts: top_k of them, each 2 I + H wide (the
    token gathered in and its expert's output scattered back, H; the expert's activation, its gate and up, 2 I; I
    from an expert's parameters, 3 H I); 0 for a dense layer."""
    experts = cfg.expert_params(layer)
    if not experts:
        return 0.0
    n, k = cfg.experts if cfg.generic else (cfg.moe.num_experts, cfg.moe.top_k)
    inter = experts / n / (3 * cfg.hidden_size)
    return k * (2 * inter + cfg.hidden_size)


def piece_seconds(cfg, layer: int, machine: Machine) -> float:
    """Seconds of layer ``layer``'s cost each piece it computes beyond its FLOPs, whatever the piece's tokens: its
    weights' gradient summed (and the like) at the GPU's piece rate, its routed experts' (every expert's weights read
    by the grouped matmuls, every expert's gradient summed) at the experts' piece rate."""
    experts = cfg.expert_params(layer)
    return (cfg.layer_params(layer) - experts) / machine.gpu_piece_rate + experts / machine.gpu_expert_piece_rate


def head_flops(cfg) -> float:
    """FLOPs of the loss per token: the LM head's forward and backward."""
    return 6.0 * cfg.hidden_size * cfg.vocab_size


def build(cfg, dtype: torch.dtype, rows: int, seq: int, micro_batches: int, machine: Machine,
          device: torch.device, loss_chunk: int, time_it: bool = True) -> Workload:
    """The workload of steps of ``micro_batches`` micro-batches of ``rows`` x ``seq`` tokens."""
    tokens = rows * seq * micro_batches
    itemsize = torch.empty((), dtype=dtype).element_size()
    boundary = (cfg.num_layers + 1) * cfg.hidden_size * itemsize
    layer_p = layer_params(cfg)
    head_p = cfg.vocab_size * cfg.hidden_size
    # the fp32 accumulator of a layer's gradient and its partial sum read back; the embedding's fp32 gradient
    # (vocab x hidden) at the end of the backward, unless it is summed in its home in HBM or is the tied LM
    # head's (the loss's fp32 gradient, into which every micro-batch's is added, is in the loss's measured
    # working set, or its estimate)
    embed_grad = 0 if cfg.tie_word_embeddings else 4 * head_p
    grads = 8 * layer_p + embed_grad
    timed = None
    # (on a CPU the figures planned with are another machine's, the H200's or a probe file's: timed here, the
    # layer would mix this CPU's speed into them, and tests planned from fixed figures would turn on this machine's
    # load)
    if time_it and device.type == "cuda" and head_p * itemsize < (8 << 30):
        try:
            timed = _time(cfg, dtype, rows, seq, device, loss_chunk)
        except torch.OutOfMemoryError:
            timed = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    embed_bwd = 0.0
    if timed is not None:
        f_mb, b_mb, h_mb, g_step, e_step = (x * IN_STEP for x in timed[:5])
        (layer_work, head_work), kept, saves = timed[5], timed[6], timed[7]
        work = max(layer_work, head_work)
        if kept is None:  # (measuring the kept graph ran out of memory: estimated as without timing)
            kept = kept_estimate(cfg, rows, seq, itemsize)
        fwd_l, bwd_l, head = f_mb * micro_batches, b_mb * micro_batches + g_step, h_mb * micro_batches
        embed_bwd = e_step
        how = (f"timed on {device.type}: one layer, its gradient's handling, the loss and the embedding's "
               f"gradient at {rows}x{seq} tokens (x{IN_STEP} in a step)")
    else:
        rate = machine.gpu_tflops
        fwd_l = {i: layer_seconds(cfg, seq, i, machine) * tokens for i in range(cfg.num_layers)}
        bwd_l, head = {i: 3 * f for i, f in fwd_l.items()}, head_flops(cfg) * tokens / rate
        layer_work = layer_work_estimate(cfg, rows, seq, itemsize)
        head_work = 0  # (estimated as held beside the layer's, below: only the layer's part scales with rows)
        # (the loss's fp32 logits and their gradient, one chunk of the piece's tokens at a time, whatever its rows:
        # trainer.model.layers.head_loss_backward; + the loss's fp32 gradient)
        work = layer_work + min(rows * seq, loss_chunk) * cfg.vocab_size * 4 * 2 + 4 * head_p
        kept, saves = kept_estimate(cfg, rows, seq, itemsize), kept_saves_estimate(cfg, rows, seq, machine)
        attention = machine.gpu_attention_tflops
        how = (f"estimated from FLOPs at {rate / 1e12:.3g} TFLOP/s"
               + (f", attention's at {attention / 1e12:.3g}" if attention != rate else "")
               + (f", routed experts' at {machine.gpu_expert_tflops / 1e12:.3g}" if expert_params(cfg) else "")
               + (" (an assumed figure)" if "gpu_tflops" in machine.assumed else " (the machine's figure)"))
    fwd = fwd_l if isinstance(fwd_l, dict) else {i: fwd_l for i in range(cfg.num_layers)}
    bwd = bwd_l if isinstance(bwd_l, dict) else {i: bwd_l for i in range(cfg.num_layers)}
    # (a layer's cost a piece: in the timings, the heaviest layer's as every layer's; else each layer's, added)
    heavy = heaviest_layer(cfg) if timed else None  # (once: it reads every weight's shape)
    pieces = {i: piece_seconds(cfg, i if heavy is None else heavy, machine) for i in bwd}
    piece = sum(pieces.values()) / len(pieces)
    if timed is None:
        c = seq_chunk(cfg, rows, seq)  # (a long row's layer sums each chunk's gradient)
        bwd = {i: s + micro_batches * (1 if c is None else -(-seq // c)) * pieces[i] for i, s in bwd.items()}
    fwd["head"], bwd["head"] = head / 3, 2 * head / 3
    fwd["embed"], bwd["embed"] = 0.0, embed_bwd
    dense, attention = flops_per_token(cfg, seq)
    return Workload(list(range(cfg.num_layers)), "embed", "head", fwd, bwd, tokens, micro_batches, boundary,
                    int(work + grads), dense, cfg.tie_word_embeddings, how,
                    kept_bytes=int(kept), embed_grad_bytes=int(embed_grad), micro_rows=rows,
                    layer_work_bytes=int(layer_work), head_work_bytes=int(head_work),
                    attention_flops_per_token=attention, kept_saves=saves, piece_seconds=piece)


def kept_estimate(cfg, rows: int, seq: int, itemsize: int) -> int:
    """Bytes a kept layer's graph holds for a micro-batch of ``rows`` x ``seq`` tokens, estimated: the whole layer's
    saved activations, or over rows cut into chunks the attention's (q, k, v, its output, its log-sum-exp)."""
    if seq_chunk(cfg, rows, seq) is None:
        return rows * seq * (10 * cfg.hidden_size + 4 * _inter(cfg)) * itemsize
    return rows * seq * ((2 * cfg.q_size + 2 * cfg.kv_size) * itemsize + 4 * cfg.num_heads)


def kept_saves_estimate(cfg, rows: int, seq: int, machine: Machine) -> float:
    """The share of a layer's forward that a kept layer's backward skips, estimated from FLOPs: all of it, or over
    rows cut into chunks q/k/v and the attention's forward."""
    if seq_chunk(cfg, rows, seq) is None:
        return 1.0
    i = heaviest_layer(cfg)
    qkv = 2.0 * cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) / machine.gpu_tflops
    attention = attention_flops_per_token([attention_layers(cfg)[i]], seq) / 3 / machine.gpu_attention_tflops
    return min(1.0, (qkv + attention) / layer_seconds(cfg, seq, i, machine))


def seq_chunk(cfg, rows: int, seq: int) -> int | None:
    """The tokens of each row a layer of this run computes at once (``trainer.model.chunked``), None: whole."""
    return None if cfg.generic else chunked.chunk_of(cfg.seq_chunk, rows, seq)


def layer_work_estimate(cfg, rows: int, seq: int, itemsize: int) -> int:
    """GPU memory a layer's forward + backward of one micro-batch needs beyond its input, estimated: a whole
    layer's backward keeps about 14 hidden-sized and 4 intermediate-sized tensors per token; a layer in sequence
    chunks (a long row) about 9 hidden-sized per token of the row (q, k, v, the attention's output, their and the
    output's gradients, the attention kernel's fp32 scratch) and the whole layer's of one chunk."""
    per_token = (14 * cfg.hidden_size + 4 * _inter(cfg)) * itemsize
    c = seq_chunk(cfg, rows, seq)
    if c is None:
        return rows * seq * per_token
    return rows * seq * 9 * cfg.hidden_size * itemsize + rows * c * per_token + 4 * layer_params(cfg)  # (+ the
    # chunks' fp32 sum of the weights' gradients)


def _inter(cfg) -> int:
    """A token's intermediate width in a layer's feed-forward (its top-k experts' for a sparse model)."""
    if cfg.moe is not None:
        return cfg.moe.top_k * cfg.moe.intermediate_size
    return 4 * cfg.hidden_size if cfg.generic else cfg.intermediate_size


def _time(cfg, dtype: torch.dtype, rows: int, seq: int, device: torch.device, loss_chunk: int):
    """Seconds of one micro-batch's layer forward, layer backward with recompute (its gradient cast to fp32
    and added up), and loss with its backward; of a layer's gradient handled once a step (its squared norm,
    its copy home) and of the embedding's gradient; and the bytes of GPU memory they need beyond their
    inputs (the layer's, the loss's). As the executor runs them (trainer.run.executor), through the model's stages
    (the heaviest layer)."""
    gen = torch.Generator(device=device).manual_seed(0)
    stages = model_stages(cfg, dtype, device)
    layer = heaviest_layer(cfg)
    groups: dict = {}
    for lw in all_weights(cfg):
        if lw.group in (layer, "embed", "head"):
            groups.setdefault(lw.group, {})[lw.local] = init_weight(lw, cfg, gen, device).to(dtype)
    w, embed_w, head_w = groups.get(layer, {}), groups["embed"], groups["head"]
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), device=device, generator=gen)
    ctx = stages.contexts([ids], [None], 1, True)[0]
    with torch.no_grad():
        x = stages.embed(embed_w, ids, ctx).detach()  # (and what the generic path's layers are handed)
    x = x + 0.5 * torch.randn(x.shape, device=device, dtype=dtype, generator=gen)  # (a layer's input scale)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def fwd():
        with torch.no_grad():
            stages.layer(layer, w, x, ctx)

    acc = {k: torch.zeros(t.shape, dtype=torch.float32, device=device) for k, t in w.items()}
    home = {k: torch.empty_like(a) for k, a in acc.items()}

    def bwd():
        for a, g in zip(acc.values(), stages.layer_backward(layer, w, x, torch.ones_like(x), ctx)[1]):
            a.add_(g)

    def grad_step():
        squared_norm(list(acc.values()))
        for k, a in acc.items():
            home[k].copy_(a)

    def timed(fn, reps: int = 3) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    reps = 1 if rows * seq > chunked.AUTO_WHOLE else 3  # (a long row's layer runs for seconds: once after the first)
    t_f = timed(fwd, reps)
    t_b = timed(bwd, reps)
    t_g = timed(grad_step)
    layer_work = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    gy = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)

    def embed_grad():
        sum(g.pow(2).sum() for g in stages.embed_grads(embed_w, [ids], [gy], [ctx], None).values())

    t_e = timed(embed_grad, min(reps, 2))
    kept = _kept_bytes(stages, layer, w, x, ctx)  # (a row cut into chunks: its attention's graph alone)
    c = stages.chunk(x, ctx)
    saves = 1.0 if c is None else min(1.0, timed(lambda: chunked.kept_skips(
        w, x, ctx.rope, cfg, cfg.window(layer), c, stages.parts[0]), reps) / max(t_f, 1e-9))
    targets = torch.randint(0, cfg.vocab_size, (rows, seq), device=device, generator=gen)
    tied = embed_w if cfg.tie_word_embeddings else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t_h = timed(lambda: stages.head_loss_backward(x, targets, head_w, tied, 1.0, loss_chunk), min(reps, 2))
    head_work = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    return t_f, t_b, t_h, t_g, t_e, (layer_work, head_work), kept, saves


def _kept_bytes(stages, layer, w: dict, x: torch.Tensor, ctx) -> int:
    """Bytes the layer's forward graph keeps for one micro-batch (what tiermem_keep_activations holds per
    layer): the storages autograd saves, less the weights', the input's and the output's (held anyway); None
    when the graph does not fit the GPU now (the layer's timings stand)."""
    held = {t.untyped_storage().data_ptr() for t in [x, *w.values()]}
    saved: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            saved[st.data_ptr()] = st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, graph = stages.layer_graph(layer, w, x, ctx)
    except torch.OutOfMemoryError:
        return None
    saved.pop(y.untyped_storage().data_ptr(), None)  # (the output is the next layer's boundary activation)
    del graph
    return sum(saved.values())
