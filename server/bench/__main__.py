"""`python -m server.bench serve ...`: the same as `cellserve bench serve ...`."""

import sys

from server.bench.serve import main_with_subcommand

if __name__ == "__main__":
    sys.exit(main_with_subcommand(sys.argv[1:]))
