"""What the server itself learns about each client: per-client ε over its participations.

The run's ``PrivacyLedger`` bounds what observers of the
released model learn (the trusted-server threat model). When clients noise their own
uploads and no secure aggregation hides them (``dp.noise-site = "client"``, Laplace,
CP-NP deltas seen by an edge), the server sees every noisy upload on its own, and it
knows whom it asked: no amplification by sampling holds against it. Against the server
each client's ε is then the composition of the releases of the rounds it was asked to
train in (the local threat model), counted when the message is sent, answered or not.

Design notes: ``docs/notes.md``, ``privacy.local_view``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from privacy.accounting import PrivacyLedger
from privacy.events import AccountingError, Release, neighboring_name

SCHEMA = "flower-privacy-lab/local-view"


def _unit(release: Release) -> Release:
    """The mechanism of ``release``, without what differs from round to round."""
    return replace(release, server_round=0, count=1, note="", sample_size=1, population=1)


def _multiplier(release: Release) -> float:
    assert release.noise_multiplier is not None  # a Gaussian release carries one
    return release.noise_multiplier


def noisy_upload(noise_multiplier: float, server_round: int) -> Release:
    """One client's clipped update and its own Gaussian noise share, as the server sees
    it: multiplier ``noise_multiplier`` (sensitivity included), no amplification."""
    return Release(
        server_round=server_round,
        kind="noisy-upload",
        mechanism="gaussian",
        noise_multiplier=noise_multiplier,
        sampling="none",
        sample_size=1,
        population=1,
        note="one client's clipped update and its own noise share, seen by the server",
    )


class LocalViewLedger:
    """Per-client composition of the uploads the server sees one by one.

    Parameters
    ----------
    accountant : {"rdp", "pld"}
        dp-accounting accountant.
    target_delta : float
        δ of the reported ε.
    neighboring : {"add-or-remove-one", "replace-one"}
        The run's neighbouring relation, stated in the summary. Releases carry its
        sensitivity in their noise multiplier (z/2 under replace-one) or Laplace ε, so
        they are composed as unsampled events under add-or-remove-one, which applies no
        further factor (dp-accounting's PLD would double a Gaussian's sensitivity under
        REPLACE_ONE, its RDP would not).
    mechanisms : tuple of str
        Mechanisms the releases use ("gaussian", "laplace").
    max_epsilon : float, optional
        Budget: ``would_exceed`` says whether one more release would take some
        client above it.
    """

    def __init__(
        self,
        *,
        accountant: str,
        target_delta: float,
        neighboring: str,
        mechanisms: tuple[str, ...] = ("gaussian",),
        max_epsilon: float | None = None,
    ) -> None:
        self._accountant = accountant
        self._target_delta = target_delta
        self._mechanisms = tuple(mechanisms)
        self._new_ledger()  # validates the configuration now
        self._neighboring = neighboring_name(neighboring)
        self.max_epsilon = max_epsilon
        self._units: list[Release] = []  # the distinct mechanisms, first-charge order
        self._clients: dict[str, list[int]] = {}  # client -> count per unit
        self._all: list[int] = []  # counts charged to every client (resumed rounds)
        self._rounds: list[int] = []  # counts charged at all (to anyone), per unit
        self._cache: dict[tuple[int, ...], float] = {}

    @classmethod
    def beside(cls, ledger: PrivacyLedger, mechanisms: tuple[str, ...] = ("gaussian",)):
        """The local view of the run whose central ledger is ``ledger`` (same accountant,
        δ, neighbouring relation and budget)."""
        return cls(
            accountant=ledger.accountant,
            target_delta=ledger.target_delta,
            neighboring=ledger.neighboring,
            mechanisms=mechanisms,
            max_epsilon=ledger.max_epsilon,
        )

    @property
    def neighboring(self) -> str:
        """The run's neighbouring relation."""
        return self._neighboring

    @property
    def target_delta(self) -> float:
        """δ of the reported ε."""
        return self._target_delta

    def _new_ledger(self) -> PrivacyLedger:
        return PrivacyLedger(
            accountant=self._accountant,
            target_delta=self._target_delta,
            sampling="none",
            mechanisms=self._mechanisms,
        )

    # -- charging ------------------------------------------------------------------
    def _index(self, release: Release) -> int:
        if release.sampling != "none":
            raise AccountingError(
                "the server knows whom it asked: a local-view release claims no "
                f"amplification (sampling 'none'), got {release.sampling!r}"
            )
        unit = _unit(release)
        if unit not in self._units:
            self._units.append(unit)
        return self._units.index(unit)

    def charge(self, clients: list[str], *releases: Release) -> None:
        """Count each release (``release.count`` times) for each of ``clients``."""
        for release in releases:
            self._charge(clients, release)

    def _charge(self, clients: list[str], release: Release) -> None:
        index = self._index(release)
        self._rounds.extend([0] * (index + 1 - len(self._rounds)))
        self._rounds[index] += release.count  # whoever was asked (the bound's counts)
        for client in clients:
            counts = self._clients.setdefault(client, [])
            counts.extend([0] * (index + 1 - len(counts)))
            counts[index] += release.count

    def charge_all(self, *releases: Release) -> None:
        """Count each release for every client, those not seen yet included."""
        for release in releases:
            index = self._index(release)
            self._all.extend([0] * (index + 1 - len(self._all)))
            self._all[index] += release.count

    # -- reading -------------------------------------------------------------------
    def _total(self, counts: list[int]) -> tuple[int, ...]:
        """A client's counts plus those charged to every client, trailing zeros cut."""
        total = [0] * len(self._units)
        for part in (counts, self._all):
            for i, c in enumerate(part):
                total[i] += c
        while total and total[-1] == 0:
            total.pop()
        return tuple(total)

    def _epsilon(self, signature: tuple[int, ...]) -> float:
        """ε of a count vector: exact when every release is Gaussian (they compose into
        one Gaussian, ``privacy.composition.gaussian_epsilon``), else the accountant's
        (Laplace: the smaller of it and basic composition)."""
        if signature not in self._cache and all(
            u.mechanism == "gaussian" for u, c in zip(self._units, signature, strict=False) if c
        ):
            from privacy.composition import gaussian_epsilon  # on use (privacy.accounting)

            pairs = zip(self._units, signature, strict=False)
            precision = math.fsum(c / _multiplier(u) ** 2 for u, c in pairs if c)
            self._cache[signature] = (
                gaussian_epsilon(precision**-0.5, self.target_delta) if precision else 0.0
            )
        if signature not in self._cache:
            ledger = self._new_ledger()
            # signature may be shorter than the units (trailing zeros are cut)
            pairs = zip(self._units, signature, strict=False)
            releases = [replace(u, count=c) for u, c in pairs if c]
            if releases:
                ledger.charge(releases)
            self._cache[signature] = ledger.epsilon()
        return self._cache[signature]

    def _maximal(self, signatures: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The signatures no other one dominates (ε grows with every count)."""

        def dominated(a, b):
            padded = max(len(a), len(b))
            a, b = a + (0,) * (padded - len(a)), b + (0,) * (padded - len(b))
            return a != b and all(x <= y for x, y in zip(a, b, strict=True))

        return [s for s in signatures if not any(dominated(s, o) for o in signatures)]

    def epsilon(self, client: str) -> float:
        """ε of ``client`` against the server (0 before it was asked)."""
        return self._epsilon(self._total(self._clients.get(client, [])))

    def worst(self) -> tuple[str | None, float]:
        """The client with the largest ε and that ε; (None, ε of the rounds charged to
        every client) before any client was asked."""
        if not self._clients:
            return None, self._epsilon(self._total([]))
        signatures = {c: self._total(counts) for c, counts in self._clients.items()}
        best = {s: self._epsilon(s) for s in self._maximal(set(signatures.values()))}
        client = max(
            (c for c, s in signatures.items() if s in best), key=lambda c: best[signatures[c]]
        )
        return client, best[signatures[client]]

    def bound(self) -> float:
        """ε against the server of a client asked in every round charged so far: an
        upper bound on every client's, independent of who was sampled (publishable)."""
        return self._epsilon(self._total(self._rounds))

    def participations(self, client: str) -> int:
        """Releases counted for ``client`` (its own and those charged to every client)."""
        return sum(self._total(self._clients.get(client, [])))

    def would_exceed(self, *releases: Release) -> bool:
        """Whether one more round of ``releases`` would take a client asked in every
        round (``bound``) above ``max_epsilon``: the answer depends on the rounds
        run only, not on who was or will be sampled, so the stop it causes is public."""
        if self.max_epsilon is None:
            return False
        for release in releases:
            self._index(release)
        return self._epsilon(self._add(self._total(self._rounds), releases)) > self.max_epsilon

    def refusal(self, server_round: int, *releases: Release) -> str | None:
        """Why round ``server_round`` must not run (a client asked in every round would
        exceed the budget against the server), or None."""
        if not self.would_exceed(*releases):
            return None
        return (
            f"round {server_round} would take the epsilon against the server of a "
            f"client asked in every round above 'dp.max-epsilon' = "
            f"{self.max_epsilon} (so far {self.bound():.4f}); nothing was sent"
        )

    def _add(self, signature: tuple[int, ...], releases: tuple[Release, ...]) -> tuple[int, ...]:
        total = list(signature) + [0] * (len(self._units) - len(signature))
        for release in releases:
            total[self._units.index(_unit(release))] += release.count
        return tuple(total)

    def summary(self) -> dict:
        """The worst client's ε and what it rests on (curator only: it depends on who
        was sampled), beside the publishable ``bound``."""
        client, epsilon = self.worst()
        return {
            "bound": self.bound(),
            "epsilon": epsilon,
            "target-delta": self.target_delta,
            "worst-client": client,
            "participations": self.participations(client) if client else sum(self._all),
            "clients": len(self._clients),
            "accountant": self._accountant,
            "neighboring-relation": self.neighboring,
            "max-epsilon": self.max_epsilon,
        }

    # -- serialisation ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable counts (the configuration is the run's)."""
        return {
            "schema": SCHEMA,
            "units": [asdict(u) for u in self._units],
            "clients": {c: list(counts) for c, counts in self._clients.items()},
            "all": list(self._all),
            "rounds": list(self._rounds),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``.

        Raises
        ------
        AccountingError
            If the state is not a local-view state or its counts are malformed.
        """
        if not isinstance(state, dict) or state.get("schema") != SCHEMA:
            raise AccountingError(f"not a {SCHEMA} state")
        try:
            units = [Release(**u) for u in state["units"]]
            clients = {str(c): [int(n) for n in v] for c, v in state["clients"].items()}
            every = [int(n) for n in state["all"]]
            rounds = [int(n) for n in state["rounds"]]
        except (KeyError, TypeError, ValueError) as err:
            raise AccountingError(f"malformed {SCHEMA} state: {err}") from None
        counts = [n for v in clients.values() for n in v] + every + rounds
        lists = [*clients.values(), rounds]
        if any(n < 0 for n in counts) or any(len(v) > len(units) for v in lists):
            raise AccountingError(f"malformed {SCHEMA} state: counts do not fit the units")
        for v in clients.values():  # no client is asked more often than rounds ran
            if any(c > (rounds[i] if i < len(rounds) else 0) for i, c in enumerate(v)):
                raise AccountingError(f"malformed {SCHEMA} state: a client exceeds the rounds")
        self._units, self._clients, self._all, self._rounds = units, clients, every, rounds
        self._cache = {}
