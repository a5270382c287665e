"""How a job trains, in the order the data flows (``run.train`` strings it together).

    run         one job: config -> launch environment -> checks -> process group -> run ->
                data/model -> loop -> checkpoint -> summary
    checks      everything that can be refused before a process group or a run exists
    checkpoint  finding, sharing, saving and resuming checkpoints (and ``ddplab checkpoint``)
    job         building the job: data, model (spread by strategy), optimizer, what the run records
    strategy    ddp, zero, fsdp, dp: wrapping the model (DDP knobs, comm hooks, IPEX)
    fit         the epochs and the job's end; loop the steps and evaluation inside them
    profiling   torch.profiler around the loop, when asked
    summary     progress lines and summary.json
    jobend      the signals that stop a job, how its run then ends, and its last line
"""
