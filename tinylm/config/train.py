"""The `train:` section: the pretrain stage's keys, each with its default and explanation."""

from __future__ import annotations

from dataclasses import dataclass

from tinylm.keys import key


@dataclass
class TrainConfig:
    """stage `pretrain`"""

    seed: int = key(
        0,
        lo=0,
        help="rank r seeds torch, numpy and random with `seed + r`",
        more="(the model is initialised on rank 0 and broadcast); the global batch of each step is a pure "
        "function of (`data_seed`, step), and `data_seed` is this seed unless set",
    )
    data_seed: int | None = key(
        None,
        lo=0,
        help="seed of the data order (each step's batch, the validation estimates' draws); `null` = `seed`",
        more="Set it to vary the data order while `seed` keeps the initialisation (and the dropout masks); "
        "a sweep repeats it with the top-level `seed_key: train.data_seed`. Null and `seed` are the same run "
        "(left out of its identity), so runs from before the key keep their hash and their bytes",
        null_means="seed",
    )
    init_from: str | None = key(
        None,
        help="start from another run's checkpoint: a run of this config by name (`default` or one of "
        "`runs:`), or a folder of published checkpoints (a path with a `/`); `null`: random initialisation",
        more="The run takes the weights of `init_step` and trains on from that step to `max_iters` with its "
        "own schedule, seed and data order (the batches of those steps), the optimizer state fresh unless "
        "`init_optimizer`: a cooldown branch of a constant-rate run, more steps of a finished one, or "
        "continued pretraining on another corpus (encoded with the parent's tokenizer). Its tokenizer is "
        "the parent's, and its model keys may differ from the parent's only where no weight's shape "
        "does (`context_length`, `rope_theta`, `dropout`, `logit_softcap`, `zero_init_output`). Under "
        "Snakemake the run depends on its parent's checkpoints; every manifest records the parent (its "
        "checkpoint, step and weights' sha256), and a resume from steps of another parent starts afresh",
        left_out_at=None,
    )
    init_step: int | None = key(
        None,
        lo=1,
        help="the step of `init_from` to start from; `null`: its newest (a run: its last, `max_iters`)",
        left_out_at=None,
    )
    mixture: dict[str, float] | None = key(
        None,
        help="`{run: weight, ...}`: train on these runs' training tokens, each drawn by its weight",
        more="Each sequence of a batch comes from one run's token files, drawn by the weights (normalised) "
        "from the data order's generator, so the batches are the same at any world size and on resume. "
        "The runs named must encode with this run's tokenizer (the same first ancestor, see `init_from`); "
        "by hand, `pretrain --train-tokens` takes their token files in the order of their names; "
        "this run's own corpus, which it may name too, gives its validation set. `null`: its own corpus only",
        left_out_at=None,
    )
    init_optimizer: bool = key(
        False,
        help="with `init_from`: carry the parent checkpoint's optimizer state (moments, step counts)",
        more="instead of starting it fresh; the hyperparameters stay this run's. The parent must have "
        "trained with the same `optimizer`, and the checkpoint must hold its state (a published folder "
        "keeps it for its newest step only), or the run is refused in one line before anything is "
        "written. With the parent's config otherwise, the branch trains exactly as the parent would have "
        "gone on (tested bit for bit)",
        left_out_at=False,
    )
    world_size: int = key(
        2,
        lo=1,
        help="data-parallel ranks (`mp.spawn`, or the WORLD_SIZE of torchrun, which must match)",
        more="May change on resume: the data stream is the same",
        execution=True,
    )
    backend: str = key(
        "auto",
        choices=["auto", "gloo", "nccl"],
        help="`auto` (nccl with CUDA, else gloo) | `gloo` | `nccl`",
        more="`auto`: nccl with one CUDA device per rank when the machine has enough, otherwise gloo on the "
        "CPU (said in one line when GPUs exist but are fewer than the ranks, so the default config runs "
        "anywhere); `gloo` (CPU); `nccl` (refused before anything starts when the machine has fewer CUDA "
        "devices than ranks)",
        execution=True,
    )
    threads_per_rank: int = key(
        1,
        lo=1,
        help="`torch.set_num_threads` in each rank",
        more="(part of the reproducibility promise)",
        execution=True,
    )
    timeout_s: float = key(
        300.0,
        lo=1.0,
        help="collective timeout: a crashed or hung rank ends the job within about this long",
        more="While checkpointing: a rank that makes no progress for this long (a slow disk still makes "
        "progress)",
        execution=True,
    )
    batch_size: int = key(
        32,
        lo=1,
        help="global batch (sequences per update), the same at any world size",
        more="Its window starts are drawn from a generator seeded by (`data_seed`, step) alone; rank r's "
        "micro-batch m is slice r * `grad_accum_steps` + m of it. So every world size and accumulation "
        "trains on the very same tokens (must be divisible by `world_size * grad_accum_steps`)",
    )
    grad_accum_steps: int | str = key(
        1,
        lo=1,
        words=["auto"],
        help="micro-steps per update (gradient accumulation); `auto`: the fewest that fit in memory",
        more="Each rank runs `batch_size / (world_size * grad_accum_steps)` sequences at a time, all "
        "micro-steps but the last inside `ddp.no_sync()`, each micro-loss divided by `grad_accum_steps`. "
        "Raise it when the global batch does not fit in memory; it costs little speed once the micro-batch "
        "keeps the device busy. `auto` takes the smallest divisor of the per-rank batch whose memory plan "
        "(`python -m tinylm pretrain --plan`) fits, says which in the log, and keeps it on resume",
        execution=True,
    )
    dtype: str = key(
        "auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="forward-pass autocast: `auto` (bfloat16 where the device computes it natively, else float32) | "
        "`float32` | `bfloat16` | `float16`",
        more="`auto` takes bfloat16 on a CUDA GPU with native bfloat16 and on a CPU with AVX-512 BF16 or AMX "
        "(or an Arm CPU with bfloat16 matmul instructions that oneDNN uses), float32 elsewhere; the run's "
        "first lines say which and why, and the manifest records it (`python -m tinylm env` says it "
        "without training). Without native support bfloat16 runs through torch's reference kernels, an "
        "order of magnitude slower than float32: an explicit `bfloat16` there still runs and says what a "
        "matmul of the model's shape costs. A resume that would resolve to another dtype is refused. "
        "Parameters and optimizer state stay float32 and the loss is computed in float32. `float16` "
        "uses dynamic loss scaling (`tinylm.precision.LossScaler`, the rule and state of "
        "`torch.amp.GradScaler`): "
        "an update whose gradients overflow (a non-finite global gradient norm, the same on every rank) is "
        "skipped on every rank alike and the scale halves; its state is in the checkpoint",
    )
    compile: bool = key(
        False,
        help="`torch.compile` the model (compiles once, at the first step)",
        more="On one GPU the whole model with its loss is one graph. Under DDP, and on the CPU, each block "
        "is compiled on its own (one compiled graph, reused by every block; two with "
        "`model.value_embeddings`), so that each block's backward is one autograd node and DDP's gradient "
        "buckets start their communication while earlier blocks are still in backward (a whole-model "
        "graph would start none before its backward ends), and on CUDA the loss region too. Each rank's "
        "Inductor gets `cores / ranks on this machine` compile threads (at least 1; "
        "`TORCHINDUCTOR_COMPILE_THREADS` wins). The first step includes the compilation and its time is "
        "printed. Checkpoints keep plain parameter names. Pays on GPUs and for larger models; on the CPU "
        "measure first (bench/train_step.py)",
        execution=True,
    )
    activation_checkpointing: str = key(
        "none",
        choices=["none", "full", "selective"],
        help="blocks recomputed in backward instead of keeping their activations: `none` | `full` | "
        "`selective` (every second block)",
        more="Trades compute for memory (torch's non-reentrant checkpoint, `Transformer."
        "set_activation_checkpointing`): `full` keeps only each block's input, for about one more forward "
        "pass; `selective` recomputes blocks 0, 2, 4, ...: about half the saving for half the cost. The "
        "gradients are exactly those without it (same kernels, same inputs, dropout's RNG replayed), so it "
        "may change on resume; `python -m tinylm pretrain --plan` shows what it saves",
        execution=True,
    )
    deterministic: bool = key(
        True,
        help="deterministic kernels (bit-identical reruns) instead of the fastest (TF32, measured attention)",
        more="`true`: `torch.use_deterministic_algorithms(True)` (an op without a deterministic kernel is an "
        "error, not a warning), deterministic flash / memory-efficient attention backward, cuDNN attention "
        "off, a fixed cuBLAS workspace and no TF32, so a CUDA run reproduces bit for bit on the same "
        "machine. `false`: the fastest kernels, TF32 matmuls for float32 and the fused attention kernel "
        "(flash, cuDNN or memory-efficient) that a measurement at the start of the run finds fastest on "
        "the GPU (the log says which and the times); reruns differ in the last bits. On the CPU the cost "
        "is nil (the same kernels run). On GPUs it costs the "
        "deterministic attention backward and, for float32 models, the TF32 matmul speed-up; the "
        "deterministic rows of `bench/gpu.py` (bench/gpu_session.sh) measure it, not yet on a GPU",
        execution=True,
    )
    peak_flops: float | None = key(
        None,
        lo=0.0,
        lo_open=True,
        help="peak FLOP/s of one device for the MFU in the log; `null` = a table of common GPUs",
        more="(`tinylm/throughput.py`: bfloat16/float16, TF32 or float32 column by dtype); on the CPU MFU is "
        "shown only when this is set",
        execution=True,
    )
    max_iters: int = key(1400, lo=1, help="optimizer steps")
    lr_max: float = key(6e-3, lo=0.0, lo_open=True, help="peak learning rate, after warmup")
    lr_min: float = key(
        6e-4, lo=0.0, help="learning rate at the end of the cosine and after it", more="(<= `lr_max`)"
    )
    warmup_iters: int = key(50, lo=0, help="linear warmup steps from 0 to `lr_max`")
    cos_cycle_iters: int | None = key(
        None,
        lo=1,
        help="`cosine`: step where the cosine reaches `lr_min`; `null` = `max_iters`",
        applies_if=("schedule", "cosine"),
    )
    schedule: str = key(
        "cosine",
        choices=["cosine", "wsd"],
        help="after warmup: `cosine` (down to `lr_min`) | `wsd` (constant `lr_max`, then a linear decay to "
        "`lr_min` over the last `decay_fraction` of the steps)",
        more='`wsd` is warmup-stable-decay (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training '
        "Beyond Fixed Training Durations\"; nanochat's warmdown). Every optimizer group follows the same "
        "shape, scaled to its own peak learning rate",
    )
    decay_fraction: float = key(
        0.2,
        lo=0.0,
        lo_open=True,
        hi=1.0,
        help="`wsd`: share of `max_iters` over which the learning rate decays linearly to `lr_min`",
        more="(0 < x <= 1; rounded to whole steps, at least one; warmup and decay must not overlap)",
        applies_if=("schedule", "wsd"),
    )
    weight_decay: float = key(
        0.7,
        lo=0.0,
        help="AdamW decoupled weight decay, on the weight matrices only",
        more="(the tuned default: the held-out plays reward regularisation, see bench/RESULTS.md); with "
        "`optimizer: muon` on the embedding and the head (the Muon matrices take `muon_weight_decay`)",
    )
    beta1: float = key(0.9, lo=0.0, hi=1.0, help="AdamW first-moment decay")
    beta2: float = key(0.99, lo=0.0, hi=1.0, help="AdamW second-moment decay")
    eps: float = key(1e-8, lo=0.0, lo_open=True, help="AdamW epsilon")
    grad_clip: float = key(
        1.0, lo=0.0, lo_open=True, help="the global L2 norm of the averaged gradients is clipped to this"
    )
    optimizer: str = key(
        "adamw",
        choices=["adamw", "muon"],
        help="`adamw` (every parameter) | `muon` (Muon for the blocks' weight matrices, AdamW for the "
        "embedding, head and gains)",
        more="`adamw`: AdamW for every parameter (`tinylm/optim.py`). "
        "`muon`: Muon (`tinylm/muon.py`: Nesterov momentum, its update orthogonalised by five quintic "
        "Newton-Schulz steps, Keller Jordan's algorithm, as `torch.optim.Muon` computes it) for the 2-D "
        "weight matrices of the Transformer blocks, and AdamW (`beta1`, `beta2`, `eps`) for the token "
        "embedding, the output head (both with `weight_decay`) and every 1-D parameter (no decay). Each "
        "group has its own peak learning rate (`muon_lr`, `embedding_lr`, `head_lr`, `lr_max`) and the same "
        "warmup and cosine, from 0 to its peak and down to peak x `lr_min / lr_max`; TensorBoard gets one "
        "scalar per group (`lr/matrices`, `lr/embedding`, `lr/head`, `lr/gains`; with AdamW `lr/matrices`, "
        "`lr/gains`), and the log line shows the first group's. Works sharded, with DDP, accumulation, "
        "autocast and compile; a resume that changes it is refused (`train.optimizer differs`)",
    )
    muon_lr: float = key(
        0.02,
        lo=0.0,
        lo_open=True,
        help="`muon`: peak learning rate of the Muon matrices (the schedule scales every group alike)",
        more="Keller Jordan's default. Each matrix's step is further scaled by its shape, see "
        "`muon_adjust_lr`",
        applies_if=("optimizer", "muon"),
    )
    muon_momentum: float = key(
        0.95,
        lo=0.0,
        hi=1.0,
        help="`muon`: Nesterov momentum of the Muon matrices (below 1)",
        more="An average of the gradients, B = m B + (1 - m) G, used Nesterov-style",
        applies_if=("optimizer", "muon"),
    )
    muon_weight_decay: float = key(
        0.0,
        lo=0.0,
        help="`muon`: decoupled weight decay of the Muon matrices (`weight_decay` stays AdamW's)",
        more="W <- W (1 - lr x this); Keller Jordan's default is 0",
        applies_if=("optimizer", "muon"),
    )
    muon_ns_steps: int = key(
        5,
        lo=1,
        help="`muon`: quintic Newton-Schulz steps orthogonalising each update",
        more="(five bring every singular value of the update into about [0.68, 1.21])",
        applies_if=("optimizer", "muon"),
    )
    muon_adjust_lr: str = key(
        "original",
        choices=["original", "match_rms_adamw"],
        help="`muon`: update scale per matrix, `original` (sqrt(max(1, rows/cols))) | `match_rms_adamw` "
        "(0.2 sqrt(max(rows, cols)))",
        more="The scales of `torch.optim.Muon`'s `adjust_lr_fn`: `original` is Keller Jordan's, "
        "`match_rms_adamw` Moonshot's (an update of AdamW's size, so AdamW's lr and decay carry over)",
        applies_if=("optimizer", "muon"),
    )
    embedding_lr: float | None = key(
        None,
        lo=0.0,
        lo_open=True,
        help="`muon`: peak learning rate of the token embedding (AdamW); `null` = `lr_max`",
        more="(refused with `adamw`)",
        applies_if=("optimizer", "muon"),
    )
    head_lr: float | None = key(
        None,
        lo=0.0,
        lo_open=True,
        help="`muon`: peak learning rate of the output head (AdamW); `null` = `lr_max`",
        more="(refused with `adamw`)",
        applies_if=("optimizer", "muon"),
    )
    bucket_size_mb: float = key(
        25.0,
        lo=0.0,
        lo_open=True,
        help="DDP gradient bucket size",
        more="One all-reduce per bucket (with `shard_optimizer`, one reduce-scatter of the gradients and one "
        "all-gather of the parameters per bucket), overlapping backward. Gradients live in the buckets and "
        "are never copied: each step zeroes the buckets and backward accumulates straight into them. "
        "`pretrain --plan` says what one update sends at a world size and its time at a link's bandwidth "
        "(`--plan-bandwidth`): at hundreds of ranks the ring's latency per bucket grows, and larger "
        "buckets pay it fewer times",
        execution=True,
    )
    shard_optimizer: bool = key(
        True,
        help="ZeRO-1: with `world_size > 1` each rank keeps the optimizer state of an equal slice of every "
        "gradient bucket only",
        more="(AdamW's moments, elements split anywhere: every rank within one alignment of 1/world_size; "
        "Muon's matrices whole, shared out by equal shapes and balanced by Newton-Schulz work) and writes "
        "that slice of each checkpoint. Each gradient bucket is reduce-scattered into the slices, each rank "
        "steps its own and all-gathers the bucket's parameters back, waited for before the next forward: "
        "a step sends what plain DDP's all-reduce sends (Muon's buckets pad a rank's share to "
        "whole matrices). The gradient clip uses one small all-reduce of the slices' squared norms",
        execution=True,
    )
    log_interval: int = key(
        50,
        lo=1,
        help="a progress line every this many steps: step, loss, lr, tokens/s, MFU, peak memory, ETA",
        more="The loss is the mean over the steps since the previous line; tokens/s and MFU (model FLOPs per "
        "token, 6 x matmul weights + 12 x layers x d_model x context, over the devices' peak; see "
        "`peak_flops`) count the training steps only (validation and checkpoint writes are timed and "
        "printed on lines of their own); peak memory is CUDA's allocated memory, or the process's peak RSS "
        "on the CPU; under float16 the line also shows the loss scale",
        execution=True,
    )
    val_interval: int = key(
        250,
        lo=1,
        help="a quick validation estimate every this many steps",
        more="(`val_batches` random batches; TensorBoard `val_loss`)",
        execution=True,
    )
    val_batches: int = key(
        20,
        lo=1,
        help="random batches per validation estimate",
        more="(the `evaluate` stage computes the exact loss)",
        execution=True,
    )
    checkpoint_interval: int = key(
        250, lo=1, help="a committed checkpoint every this many steps (and at the end)"
    )
    keep_checkpoints: int = key(
        2,
        lo=2,
        help="full resume states kept (at least 2); older steps keep their weights only",
        more='(see "Disk" below)',
        execution=True,
    )

    @property
    def data_order_seed(self) -> int:
        """The seed of the data order: `data_seed`, or `seed` when it is null."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def cos_cycle(self) -> int:
        """The last step of the cosine decay (defaults to max_iters)."""
        return self.max_iters if self.cos_cycle_iters is None else self.cos_cycle_iters

    @property
    def decay_iters(self) -> int:
        """`wsd`: the number of final steps over which the learning rate decays (at least 1)."""
        return max(1, round(self.decay_fraction * self.max_iters))
