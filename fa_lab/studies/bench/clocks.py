"""The GPU's clocks beside the timings: SM and memory clock, temperature, power and the
active clock-event reasons, read through pynvml or nvidia-smi, and sampled during rounds."""

from __future__ import annotations

import subprocess
import threading
import time

import torch

from .rounds import _err, spread


#: NVML's clock-event (throttle) reason bits.
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                 0x100: "display_clock_setting"}


def clock_reasons(mask) -> list[str] | None:
    """The names of the reason bits set in ``mask`` (unknown bits as hex), None for None."""
    if mask is None:
        return None
    mask = int(mask)
    names = [n for bit, n in CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_REASONS)
    return names + ([hex(rest)] if rest else [])


def _cuda_index(device) -> int:
    dev = torch.device(device)
    return torch.cuda.current_device() if dev.index is None else dev.index


def _gpu_uuid(device) -> str | None:
    """The device's UUID as NVML and nvidia-smi name it (``GPU-...``), or None."""
    try:
        u = str(torch.cuda.get_device_properties(_cuda_index(device)).uuid)
    except Exception:
        return None
    return u if u.startswith("GPU-") else f"GPU-{u}"


_NVML: dict = {}


def _nvml(device):
    """(pynvml, the device's NVML handle), found by UUID (CUDA and NVML may number GPUs
    differently), else by torch's NVML index, else by the CUDA index."""
    import pynvml
    if "init" not in _NVML:
        pynvml.nvmlInit()
        _NVML["init"] = True
    idx = _cuda_index(device)
    if idx not in _NVML:
        try:
            _NVML[idx] = pynvml.nvmlDeviceGetHandleByUUID(_gpu_uuid(device))
        except Exception:
            try:
                nvml_idx = torch.cuda._get_nvml_device_index(idx)
            except Exception:
                nvml_idx = idx
            _NVML[idx] = pynvml.nvmlDeviceGetHandleByIndex(nvml_idx)
    return pynvml, _NVML[idx]


def _clocks_nvml(device) -> dict:
    nv, h = _nvml(device)

    def get(fn, *a):
        try:
            return fn(h, *a)
        except Exception:
            return None
    power = get(nv.nvmlDeviceGetPowerUsage)
    reasons_fn = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
    return {"source": "pynvml", "sm_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            "max_sm_mhz": get(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
            "mem_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            "temp_c": get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000,
            "reasons": clock_reasons(get(reasons_fn))}


#: nvidia-smi's fields, in the order of ``parse_smi``'s columns.
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw",
              "clocks_event_reasons.active")


def parse_smi(line: str) -> dict:
    """One line of ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``."""
    cells = [c.strip() for c in line.strip().split(",")]

    def num(c, kind=float):
        try:
            return kind(c)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"
    cells += [""] * (len(SMI_FIELDS) - len(cells))
    sm, max_sm, mem, temp, power, reasons = cells[:len(SMI_FIELDS)]
    mask = num(reasons, lambda c: int(c, 16))
    return {"source": "nvidia-smi", "sm_mhz": num(sm, int), "max_sm_mhz": num(max_sm, int),
            "mem_mhz": num(mem, int), "temp_c": num(temp, int), "power_w": num(power),
            "reasons": clock_reasons(mask)}


def _clocks_smi(device) -> dict:
    target = _gpu_uuid(device) or str(_cuda_index(device))
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                        "--format=csv,noheader,nounits", f"--id={target}"],
                       capture_output=True, text=True, timeout=10, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"nvidia-smi exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}")
    return parse_smi(r.stdout.strip().splitlines()[0])


def gpu_clocks(device="cuda") -> dict:
    """The GPU's clocks now: ``{"source", "sm_mhz", "max_sm_mhz", "mem_mhz", "temp_c",
    "power_w", "reasons"}`` (fields a source cannot give are None). Sources in turn:
    pynvml, ``nvidia-smi``, ``torch.cuda.clock_rate`` (SM clock only); none working:
    ``{"source": None, "note": why}``. Not a CUDA device: ``{"source": None, ...}``."""
    if torch.device(device).type != "cuda":
        return {"source": None, "note": f"{device}: no GPU clocks"}
    why = []
    for read in (_clocks_nvml, _clocks_smi):
        try:
            return read(device)
        except Exception as e:
            why.append(f"{read.__name__[len('_clocks_'):]}: {_err(e)}")
    try:
        return {"source": "torch.cuda.clock_rate", "sm_mhz": torch.cuda.clock_rate(_cuda_index(device))}
    except Exception as e:
        why.append(f"torch.cuda.clock_rate: {_err(e)}")
    return {"source": None, "note": "; ".join(why)}


class ClockSampler:
    """The SM clock every ``interval`` s on a thread while in use (``with``), through pynvml
    only (a call of microseconds, no process started); without pynvml it samples nothing.
    ``summary(t0, t1)``: min, median and max of the samples between two
    ``time.perf_counter`` readings."""

    def __init__(self, device="cuda", interval: float = 0.05):
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._read = None
        if torch.device(device).type == "cuda":
            try:
                nv, h = _nvml(device)
                nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                self._read = lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            except Exception:
                self._read = None
        self._stop = threading.Event()
        self._thread = None

    @property
    def active(self) -> bool:
        return self._read is not None

    def _loop(self):
        while not self._stop.wait(self.interval):
            try:
                self.samples.append((time.perf_counter(), int(self._read())))
            except Exception:
                return

    def __enter__(self):
        if self.active:
            self._thread = threading.Thread(target=self._loop, name="fa-lab clock sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self, t0: float, t1: float) -> dict | None:
        v = [mhz for t, mhz in self.samples if t0 <= t <= t1]
        if not self.active:
            return None
        return spread(v)
