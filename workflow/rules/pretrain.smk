# The resume state lives in results/state/<run hash>, outside the declared outputs: Snakemake
# deletes declared outputs before a job runs and after it fails, so a killed run rerun with
# `snakemake --rerun-incomplete` resumes from there and republishes every checkpoint.
# The progress lines go to the terminal as well as to the log (tee; Snakemake's bash runs with
# pipefail, so a failed pretrain still fails the job).
rule pretrain:
    input:
        tokenizer="results/tokenizer/tokenizer.json",
        train="results/tokens/train.npy",
        valid="results/tokens/valid.npy",
    output:
        directory("results/checkpoints"),
    params:
        cfg=section_json("corpus", "tokenizer", "model", "train"),
        state_dir=f"results/state/{RUN}",
        launcher=LAUNCHER,
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/logs/pretrain.log",
    benchmark:
        "results/benchmarks/pretrain.tsv"
    threads: config["train"]["world_size"] * config["train"]["threads_per_rank"]
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        "{params.launcher} -m tinylm pretrain --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --train-tokens {input.train} --valid-tokens {input.valid} --state-dir {params.state_dir}"
        " --checkpoint-dir {output} --tensorboard-dir results/tensorboard 2>&1 | tee {log}"
