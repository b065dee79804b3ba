"""The stage-2 command with every checkpoint read and its compiles recorded (run by
tests/test_multihost.py and tests/test_compile_cache.py, one per process of a multi-host job):
`python tests/counted_stage2.py RECORD.json STAGE2-ARGS...` runs `commands.stage2.main` on the
arguments (`RECORD.json generate ARGS...`: `commands.generate.main`, stages 1 to 3) and then
writes to RECORD.json {"reads": each read of checkpoint data as [file, offset,
bytes], "compiles": this process's compile counts (`CompileCounts.to_dict`)} (process 0 alone
writes the telemetry)."""

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
    if sys.argv[2:3] == ["generate"]:
        from commands.generate import main
        code = main(sys.argv[3:])
    else:
        from commands.stage2 import main
        code = main(sys.argv[2:])
    from tpu.compile import compile_counts
    with open(sys.argv[1], "w") as fh:
        json.dump({"reads": reads, "compiles": compile_counts().to_dict()}, fh)
    sys.exit(code)
