"""What a user asks stage 1 to encode, and the one error every up-front check raises."""

from __future__ import annotations

from dataclasses import dataclass


class EncoderInputError(ValueError):
    """Bad stage-1 input, found before any model work: `name` is the flag or file at fault,
    `expected` what would be accepted. The command prints it as one line and exits 2."""

    def __init__(self, name: str, problem: str, expected: str):
        super().__init__(f"{name}: {problem}; expected {expected}")
        self.name, self.problem, self.expected = name, problem, expected


@dataclass(frozen=True)
class Request:
    prompt: str
    negative_prompt: str | None = None  # None: the pipeline's official default negative prompt
    image: str | None = None  # path of the first frame / reference image
    audio: str | None = None  # path of the speech file (S2V)
    height: int | None = None  # None: the pipeline's default (or the image's, where it decides)
    width: int | None = None
    frames: int | None = None
    clips: int | None = None  # S2V: None = as many clips as the audio holds
