"""Frames as an H.264 mp4 file (through imageio's ffmpeg writer)."""

from __future__ import annotations


def encode_mp4(path: str, frames, fps: float, quality: int = 8) -> None:
    """Frames [F, H, W, 3] uint8 as an H.264 mp4 at `path`; the name must end in .mp4 (imageio
    picks its ffmpeg writer by the extension). `quality` is imageio's 1-10 (8, as the official Wan
    scripts write, is x264 CRF 10)."""
    import imageio.v2 as imageio

    # macro_block_size 1 keeps the size exact (the VAE strides make it even, as yuv420p needs)
    writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264",
                                quality=quality, macro_block_size=1)
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
