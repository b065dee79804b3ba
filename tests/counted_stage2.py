"""The stage-2 command with every checkpoint read recorded (run by tests/test_multihost.py):
`python tests/counted_stage2.py READS.json STAGE2-ARGS...` runs `commands.stage2.main` on the
arguments and then writes each read of checkpoint data as [file, offset, bytes] to READS.json."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modules import safetensors_reader  # noqa: E402

reads = []
_read_at = safetensors_reader.read_at


def _recorded(fd, offset, nbytes, file):
    reads.append((str(file), offset, nbytes))
    return _read_at(fd, offset, nbytes, file)


if __name__ == "__main__":
    safetensors_reader.read_at = _recorded  # the reader's one way to the file's bytes
    from commands.stage2 import main
    code = main(sys.argv[2:])
    with open(sys.argv[1], "w") as fh:
        json.dump(reads, fh)
    sys.exit(code)
