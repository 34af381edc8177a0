"""Memory and time of loading a long video: a 1920x1080 clip of a square moving over a ramp (generated once with
PyAV into ~/.cache/vlserve-bench/long_video/, a low source rate and a short GOP keep that cheap), sampled at
`--sample-fps` by `load_video` in a fresh subprocess per mode, which reports its RSS before loading, its peak RSS
(ru_maxrss) and the wall time:

- `sequential`: every frame decoded up to the last sampled one, frames kept at full size;
- `seek`: seeking to the keyframe before each sampled frame, frames kept at full size;
- `seek+processor-size`: seeking, each frame decoded at the size the demo model's video processor uses (the server's
  path; its "RSS before" includes the processor's imports: transformers, torch).

With `--serve`, it also starts `make serve`'s command (`python -m vlserve.quickstart`: the demo model, engine in the
API process), sends one chat with the clip (file://, `media_io_kwargs.video.fps`) and reports the server's RSS
before and its peak (VmHWM) after.

    .venv/bin/python -m benchmarks.long_video [--minutes 10] [--source-fps 2] [--sample-fps 1] [--serve]
    .venv/bin/python -m benchmarks.long_video --minutes 0.5 --width 640 --height 360   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "vlserve-bench", "long_video")
MODES = ("sequential", "seek", "seek+processor-size")


def clip_path(minutes: float, width: int, height: int, fps: int, gop_seconds: float) -> str:
    """The cached clip for these settings, generated (libx264, yuv420p, mp4) when missing."""
    import av
    import numpy as np

    name = f"square_{width}x{height}_{minutes:g}min_{fps}fps_gop{gop_seconds:g}s.mp4"
    path = os.path.join(CACHE, name)
    if os.path.isfile(path):
        return path
    os.makedirs(CACHE, exist_ok=True)
    tmp = path + ".part"
    frames = round(minutes * 60 * fps)
    side = height // 6
    ramp = np.linspace(0, 160, width, dtype=np.uint8)[None, :, None]  # [1, W, 1]
    with av.open(tmp, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = max(1, round(gop_seconds * fps))
        stream.options = {"preset": "veryfast", "sc_threshold": "0"}
        img = np.empty((height, width, 3), np.uint8)
        for i in range(frames):
            img[:] = ramp
            x = (i * 7) % (width - side)
            y = (i * 3) % (height - side)
            img[y : y + side, x : x + side] = (255, 255 - i % 256, i % 256)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    os.replace(tmp, path)
    return path


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def child(mode: str, path: str, sample_fps: float) -> None:
    """One measurement, in this (fresh) process: print a JSON line."""
    from vlserve.multimodal.media import load_video

    frame_size = None
    if mode == "seek+processor-size":
        from vlserve.demo import default_model_path
        from vlserve.multimodal.processor import MultiModalProcessor
        from vlserve.multimodal.video_frame_size import video_frame_size

        proc = MultiModalProcessor.from_pretrained(default_model_path())
        frame_size = video_frame_size(proc.video_processor, {}, proc.max_video_frame_pixels)
    before = _rss_mib()
    t0 = time.perf_counter()
    video = load_video(path, fps=sample_fps, seek=mode != "sequential", frame_size=frame_size)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    frames = video.frames
    print(
        json.dumps(
            dict(
                mode=mode,
                seconds=seconds,
                rss_before_mib=before,
                peak_rss_mib=peak,
                frames=len(frames),
                frame_shape="x".join(map(str, frames.shape[1:3][::-1])),
                frames_mib=frames.nbytes / 2**20,
            )
        )
    )


def _proc_status(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def serve_once(path: str, sample_fps: float, port: int, flags: list[str]) -> dict:
    """The demo server's RSS before and peak RSS after one chat with the clip at `sample_fps`."""
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "vlserve.quickstart", "--", "--port", str(port)]
    cmd += ["--allowed-local-media-path", os.path.dirname(path), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 300:
                    sys.exit(f"the server did not start; its log: {log.name}")
                time.sleep(0.5)
        before = _proc_status(proc.pid, "VmRSS")
        content = [
            {"type": "video_url", "video_url": {"url": "file://" + path}},
            {"type": "text", "text": "What moves?"},
        ]
        body = {
            "model": "vlserve-demo",
            "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
            "media_io_kwargs": {"video": {"fps": sample_fps}},
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t1 = time.perf_counter()
        reply = json.loads(urllib.request.urlopen(req, timeout=1800).read())
        seconds = time.perf_counter() - t1
        return dict(
            mode=f"serve: API process, {reply['usage']['prompt_tokens']} prompt tokens",
            seconds=seconds,
            rss_before_mib=before,
            peak_rss_mib=_proc_status(proc.pid, "VmHWM"),
            frames=None,
            frame_shape="",
            frames_mib=None,
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--source-fps", type=int, default=2, help="frame rate of the generated clip")
    parser.add_argument("--gop-seconds", type=float, default=2.0, help="keyframe interval of the generated clip")
    parser.add_argument("--sample-fps", type=float, default=1.0, help="load_video(fps=...)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--serve", action="store_true", help="also measure the demo server with one chat")
    parser.add_argument("--port", type=int, default=8023)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measurement: its mode
    parser.add_argument("--clip", default=None, help=argparse.SUPPRESS)  # ... and the clip it loads
    parser.add_argument("serve_flags", nargs="*", help="extra `vlserve serve` flags for --serve (after --)")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.clip, args.sample_fps)
    t0 = time.perf_counter()
    path = clip_path(args.minutes, args.width, args.height, args.source_fps, args.gop_seconds)
    print(f"clip: {path} ({os.path.getsize(path) / 2**20:.1f} MiB, ready in {time.perf_counter() - t0:.1f} s)")
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "benchmarks.long_video", "--child", mode, "--clip", path]
        out = subprocess.run([*cmd, "--sample-fps", str(args.sample_fps)], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.serve:
        rows.append(serve_once(path, args.sample_fps, args.port, args.serve_flags))
    print("command: " + shlex.join([".venv/bin/python", "-m", "benchmarks.long_video", *sys.argv[1:]]))
    print("| mode | frames kept | frame size | frames MiB | RSS before MiB | peak RSS MiB | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        frames_mib = "" if r["frames_mib"] is None else f"{r['frames_mib']:.0f}"
        print(
            f"| {r['mode']} | {r['frames'] or ''} | {r['frame_shape']} | {frames_mib} | {r['rss_before_mib']:.0f} "
            f"| {r['peak_rss_mib']:.0f} | {r['seconds']:.2f} |"
        )


if __name__ == "__main__":
    main()
