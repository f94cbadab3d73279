"""`train.py` with the faults of TRAINER_FAULTS injected through the trainer's hooks (tests/workers/faults.py).

    deepspeed --num_gpus 2 tests/workers/train_with_faults.py --preset tiny_cpu --set ...
"""
import argparse
import sys

from faults import Faults  # tests/workers/faults.py: the script's own directory is on sys.path

from trainer.train.cli import train, train_arguments

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train_arguments(parser)
    sys.exit(train(parser.parse_args(), hooks=Faults()))
