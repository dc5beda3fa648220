"""An exact reference for fp32 fused multiply-add (fractions, no floating-point sums) and
inputs that defeat a plain fp64 emulation: what the numerics tests and the ports' fma tests
share."""

import math
import random
from fractions import Fraction


def round_to_f32(x: Fraction) -> float:
    """The fp32 nearest to the exact x, ties to even, subnormals included, inf from
    FLT_MAX + half an ulp on (a reference in integers, independent of fp64 sums)."""
    if x == 0:
        return 0.0
    ax = abs(x)
    e = ax.numerator.bit_length() - ax.denominator.bit_length()  # 2**e <= ax < 2**(e + 2)
    e += ax >= Fraction(2) ** (e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(ax, ulp)
    n += rem > ulp / 2 or (rem == ulp / 2 and n % 2 == 1)
    r = math.inf if n * ulp >= Fraction(2) ** 128 else float(n * ulp)
    return math.copysign(r, x)


def exact_fma(x: float, y: float, z: float) -> float:
    """fma of finite fp32 values from exact fractions (an exact zero takes IEEE's sign:
    negative only when the product and the addend are both negative or zero of that sign)."""
    r = round_to_f32(Fraction(x) * Fraction(y) + Fraction(z))
    if r == 0:
        neg = math.copysign(1, x) * math.copysign(1, y) < 0 and math.copysign(1, z) < 0
        exact_zero = Fraction(x) * Fraction(y) + Fraction(z) == 0
        return (-0.0 if neg else 0.0) if exact_zero else r
    return r


FLT_MAX = float.fromhex("0x1.fffffep127")

#: (a, b, c) where the fp64 sum of the exact product and c lands on an fp32 halfway point
#: that the exact value is not on: rounding the fp64 sum to fp32 goes the wrong way.
FMA_DOUBLE_ROUNDING = [
    (1 + 2.0**-23, 2.0**-24 * (1 - 2.0**-23), 1 + 2.0**-23),  # just below a tie, odd below
    (1 + 2.0**-12, 1 + 2.0**-12, 2.0**-70),                     # just above a tie, even below
    (-(1 + 2.0**-12), 1 + 2.0**-12, -(2.0**-70)),
    (float.fromhex("0x1.0002p-75"), float.fromhex("0x1.fffcp-76"),  # fp32 subnormal results
     float.fromhex("0x1.000004p-127")),
    (float.fromhex("0x1.4a4p-80"), float.fromhex("0x1.8ce32p-71"), float.fromhex("0x1.000008p-127")),
    (18631.0, 1801 * 2.0**103, -(2.0**-149)),                   # FLT_MAX, not inf
]


def tie_hitting_triples(n: int, seed: int) -> list[tuple[float, float, float]]:
    """a * b an fp32 halfway point (25 significant bits, the last one set) at a random
    scale, c far below it: the fp64 sum is the halfway point, the exact value is not."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b = rng.getrandbits(12) | 1 << 11 | 1, rng.getrandbits(14) | 1 << 13 | 1
        if (a * b).bit_length() != 25:
            continue
        ea, eb = rng.randint(-70, 40), rng.randint(-70, 40)
        c = math.ldexp(rng.choice((1, -1)) * rng.choice((1, 3, 5)), ea + eb - rng.randint(31, 40))
        out.append((math.ldexp(a, ea) * rng.choice((1, -1)), math.ldexp(b, eb), c))
    return out
