"""Which refused argument of torch.ops.lightning_rec.parse_criteo crashes this machine, if any.

    python .ci/criteo_op_probe.py        # each call in its own process: its exit status, and a C++ backtrace
                                         # (gdb, when the machine has it) for any call that crashed

Each call below throws one TORCH_CHECK. Where the extension's C++ runtime is broken (a toolchain that links a
private, static libstdc++ can make every check whose message formats a value crash: csrc/check_message.h), the
calls that crash, and where, tell a bad throw (unwinding, the runtime the extension was built with) from a bad
read. It ends with the extension's `ldd` and the compiler's version; the exit status counts the crashes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROW = "\t".join(["0"] + [str(k) for k in range(1, 14)] + [f"{k:08x}" for k in range(1, 27)]) + "\n"
CALLS = {  # name -> the op's arguments after buf (buf: one good row unless the name says otherwise)
    "good_row": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [], 0, False",
    "no_newline": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [], 0, False",
    "one_size_mode1": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [5], 1, False",
    "one_size_mode2": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [5], 2, False",
    "size_1_mode1": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [1] * 26, 1, False",
    "hash_mode_3": "9, 40, 0, list(range(1, 14)), list(range(14, 40)), [], 3, False",
    "field_twice": "9, 40, 1, list(range(1, 14)), list(range(14, 40)), [], 0, False",
    "12_dense": "9, 40, 0, list(range(1, 13)), list(range(14, 40)), [], 0, False",
}


def one(name: str) -> str:
    buf = repr(b"1\t2" if name == "no_newline" else ROW.encode())
    return ("import torch, lightning_rec._C\n"
            f"buf = torch.frombuffer(bytearray({buf}), dtype=torch.uint8)\n"
            "try:\n"
            f"    out = torch.ops.lightning_rec.parse_criteo(buf, {CALLS[name]})\n"
            "    print('returned', [tuple(t.shape) for t in out])\n"
            "except RuntimeError as e:\n"
            "    print('raised', str(e).splitlines()[0][:120])\n")


def main() -> int:
    crashed = []
    for name in CALLS:
        run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", one(name)], capture_output=True, text=True,
                             timeout=120)
        last = (run.stdout.strip().splitlines() or [""])[-1]
        print(f"{name:<16} rc {run.returncode:>4}  {last}")
        if run.returncode != 0:
            crashed.append(name)
            print("    " + "\n    ".join(run.stderr.strip().splitlines()[:12]))
    gdb = shutil.which("gdb")
    for name in crashed[:2]:
        if gdb is None:
            print("no gdb on this machine: no C++ backtrace")
            break
        script = f"/tmp/criteo_probe_{name}.py"
        with open(script, "w") as f:
            f.write(one(name))
        bt = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, script],
                            capture_output=True, text=True, timeout=300, env=os.environ)
        print(f"--- gdb backtrace of {name}")
        print("\n".join(line for line in bt.stdout.splitlines() if line.startswith("#") or "signal" in line)[:6000])
    so = [os.path.join("lightning_rec", f) for f in os.listdir("lightning_rec") if f.startswith("_C")]
    for path in so:
        print(f"--- ldd {path}")
        print(subprocess.run(["ldd", path], capture_output=True, text=True).stdout)
    for cc in ("c++", "gcc"):
        if shutil.which(cc):
            print(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    print(f"crashed: {crashed}")
    return len(crashed)


if __name__ == "__main__":
    sys.exit(main())
