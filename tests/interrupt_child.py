"""A stage command run as a child process, held at one point so that the test can signal it there
or run a second one beside it (tests/test_interrupts.py).

    python tests/interrupt_child.py <stage2|stage3> <point> <folder for handshake files> -- argv...

point:
  loop      stage 2: after the 3rd step of the timed loop, print "held" and hold
  payload   stage 2: once the latents' temporary file is written, print "held" and hold
  encode    stage 3: after the 2nd frame went to the encoder, print "held" and hold
  commit    stage 2: wait for the file `go` before writing the stage files; print "ready" first
  half      as commit, and pause 2 s between renaming the latents in and the config
Holding is short sleeps in Python, between which the signal handler runs.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def say(word: str) -> None:
    print(word, flush=True)


def hold(seconds: float = 60.0) -> None:
    """Sleep in short naps: a signal the kernel hands to another thread (torch's, JAX's) only
    runs its Python handler when the main thread next executes bytecode."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.02)


def main() -> int:
    stage, point, folder = sys.argv[1:4]
    argv = sys.argv[sys.argv.index("--") + 1:]
    from commands import stage2, stage3
    from sampling import stage_io

    if point == "loop":
        class Held:  # stands in for the step bar: the loop calls it after every step
            def __call__(self, done, total, computed):
                if done == 3:
                    say("held")
                    hold()

            def close(self):
                pass
        stage2.progress.steps = lambda total, desc="denoise": Held()
    elif point == "payload":
        real_save = stage_io.write_tensors

        def save(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)
            say("held")
            hold()
        stage_io.write_tensors = save
    elif point == "encode":
        import imageio.v2 as imageio
        real_writer = imageio.get_writer

        def get_writer(*args, **kwargs):
            writer = real_writer(*args, **kwargs)
            frames = []

            def append(frame):
                type(writer).append_data(writer, frame)
                frames.append(1)
                if len(frames) == 2:
                    say("held")
                    hold()
            writer.append_data = append
            return writer
        imageio.get_writer = get_writer
    elif point in ("commit", "half"):
        real_write = stage2.write_stage2

        def write_when_told(*args, **kwargs):
            say("ready")
            while not os.path.exists(os.path.join(folder, "go")):
                time.sleep(0.02)
            return real_write(*args, **kwargs)
        stage2.write_stage2 = write_when_told
        if point == "half":
            real_replace = os.replace

            def replace(src, dst):
                real_replace(src, dst)
                if str(dst).endswith(stage_io.LATENTS):
                    say("half")
                    hold(2.0)
            stage_io.os.replace = replace
    script = "stage2_transformer_flax_deepcache.py" if stage == "stage2" else "stage3_vae_decode.py"
    sys.argv[0] = os.path.join(ROOT, script)  # the command names itself by it
    return (stage2.main if stage == "stage2" else stage3.main)(argv)


if __name__ == "__main__":
    sys.exit(main())
