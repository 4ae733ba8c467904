"""rejection_sample is exact: on five tokens, what it emits follows the target's p."""

import numpy as np

from reference.speculative import acceptance_probability, rejection_sample

p = np.array([0.10, 0.35, 0.25, 0.05, 0.25])  # the target's distribution at the draft
q = np.array([0.35, 0.15, 0.30, 0.20, 0.00])  # the draft's: it never proposes token 4
after = np.full(5, 0.2)  # the target's next row: the bonus token's (k = 1 draft here)
rows, vocab = np.stack([p, after]), range(5)


class Scripted:
    """Stands in for the generator: plays one chosen outcome of each draw, and
    multiplies up the chance of the outcomes it played."""

    def __init__(self, accept: bool, token: int) -> None:
        self.accept, self.token, self.chance = accept, token, 1.0

    def random(self) -> float:  # a draft is accepted if random() < min(1, p(x) / q(x))
        return 0.0 if self.accept else 1.0

    def choice(self, n: int, p: np.ndarray) -> int:  # a token drawn from p
        self.chance *= p[self.token]
        return self.token


# Exact: every draft x (chance q(x)), accepted or not, every token a draw may return.
exact = np.zeros(5)
for x in np.flatnonzero(q):
    accept = acceptance_probability(p[x], q[x])
    for accepted, chance in [(True, accept), (False, 1 - accept)]:
        for token in vocab if chance > 0 else []:
            rng = Scripted(accepted, token)
            emitted = rejection_sample([x], q[None], rows, rng)
            if emitted[-1] == token:  # a draw returned it (one-token rows draw nothing)
                exact[emitted[0]] += q[x] * chance * rng.chance

# Sampled: the draft draws x from q, rejection_sample verifies it, 20,000 times.
rng, counts = np.random.default_rng(0), np.zeros(5)
for _ in range(20_000):
    x = rng.choice(5, p=q)
    counts[rejection_sample([x], q[None], rows, rng)[0]] += 1
sampled = counts / counts.sum()

accept = [f"{acceptance_probability(p[x], q[x]):.3f}" if q[x] else "-" for x in vocab]
residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
for name, values in [("token", vocab), ("p (target)", p), ("q (draft)", q),
                     ("min(1, p/q)", accept), ("residual", residual),
                     ("exact", exact), ("sampled", sampled)]:
    print(f"{name:<12}" + "".join(f"{v:>7.3f}" if isinstance(v, float) else f"{v:>7}"
                                  for v in values))
print(f"max |exact - p| = {np.abs(exact - p).max():.1e}; "
      f"max |sampled - p| = {np.abs(sampled - p).max():.3f}")
print(f"a draft is accepted with probability sum(min(p, q)) = "
      f"{np.minimum(p, q).sum():.2f}")
