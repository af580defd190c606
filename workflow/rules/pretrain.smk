# The resume state lives in the run's state folder (tinylm.config.run_state_dir), outside the declared outputs:
# Snakemake deletes declared outputs before a job runs and after it fails, so a killed run rerun
# with `snakemake --rerun-incomplete` resumes from there and republishes every checkpoint.
# The progress lines go to the terminal as well as to the log (--log: the stage copies its own standard
# error, so the line that says how to resume a stopped run reaches both); each line is labelled with the
# run's name, so the runs of a sweep that train side by side can be told apart. TensorBoard gets a folder
# per run under results/tensorboard (<run name>-<run hash>), so one --logdir shows every run.
rule pretrain:
    input:
        tokenizer=run_tokenizer,
        train=train_tokens,  # with train.mixture, one file per run of it
        valid=data_file("tokens/valid.npy"),
        init=init_checkpoints,  # the parent run's checkpoints, for a run with train.init_from
    output:
        directory("results/{run_dir}checkpoints"),
    params:
        cfg=run_json("corpus", "tokenizer", "model", "train"),
        state_dir=lambda wildcards: run_state_dir(run_cfg(wildcards), wildcards.run_dir),
        run_name=lambda wildcards: RUN_OF[wildcards.run_dir],
        init=lambda wildcards, input: f"--init-dir {input.init}" if input.init else "",
        launcher=LAUNCHER,
    conda:
        "../envs/tinylm.yaml"
    log:
        "results/{run_dir}logs/pretrain.log",
    benchmark:
        "results/{run_dir}benchmarks/pretrain.tsv"
    threads: lambda wildcards: run_cfg(wildcards).train.world_size * run_cfg(wildcards).train.threads_per_rank
    resources:
        gpu=pretrain_gpus,
        mem_mb=8000,
        runtime=120,
    shell:
        "{params.launcher} -m tinylm pretrain --config-json {params.cfg:q} --tokenizer {input.tokenizer}"
        " --train-tokens {input.train} --valid-tokens {input.valid} --state-dir {params.state_dir}"
        " --checkpoint-dir {output} --tensorboard-dir results/tensorboard --run-name {params.run_name}"
        " --log {log} {params.init}"
