"""RecStrategy's parts that are not the strategy itself: loader agreement (loaders), SIGTERM / SLURM takeover
(signals), process-group lifecycle (groups). lightning_rec.strategy imports each module directly."""
