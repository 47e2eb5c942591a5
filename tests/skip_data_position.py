"""train.py whose resume does not restore the data position (the soak's companion): the stream starts over."""

import sys

from mtpjax.cli.train import main
from mtpjax.data.pipeline import BatchIterator

BatchIterator.set_state = lambda self, state: None

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
