"""What the server learns of each client when DP-FedAvg's clients noise their own uploads.

With client-side noise (``dp.noise-site = "client"``) and no secure aggregation the
server sees every sampled client's noisy upload on its own and knows whom it asked:
against the server, a client's ε composes the uploads (and SmartFedProx's divergence
reports) of the rounds it was asked in, without amplification
(:mod:`privacy.local_view`). :class:`UploadView` is that piece of DP-FedAvg, composed
only with client-side noise; like :class:`strategies.secure.distributed_dp.SecureNoise`
it is handed the wrapper on each call rather than holding it.
"""

from __future__ import annotations

import math
from logging import INFO

from flwr.common.logger import log

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.local_view import LocalViewLedger, noisy_upload
from protocol import keys
from strategies.errors import BudgetExhausted


class UploadView:
    """Each client's ledger against the server, charged when its message is sent."""

    def __init__(self, ledger: PrivacyLedger) -> None:
        self.ledger = LocalViewLedger.beside(ledger)

    def upload(self, dp, server_round: int) -> Release:
        """One client's noisy upload as the server sees it: its clipped update plus its
        own share N(0, (z_Δ C)²/m), no amplification (the server knows whom it asked)."""
        factor = l2_sensitivity_factor(dp.ledger.neighboring)
        z = dp.update_noise_multiplier() / math.sqrt(dp.num_sampled_clients) / factor
        return noisy_upload(z, server_round)

    def releases(self, dp, server_round: int) -> list[Release]:
        """What the server sees of one sampled client in one round: its noisy upload,
        and its noised divergence when the wrapped strategy asks for one."""
        z, report = dp.noise_multiplier, dp.divergence
        assert z is not None
        return [self.upload(dp, server_round)] + (
            [] if report is None else [report.release(z, server_round)]
        )

    def refuse_over_budget(self, dp, server_round: int) -> None:
        """BudgetExhausted, before anything is sent, if the round would take some client
        over the budget against the server."""
        refusal = self.ledger.refusal(server_round, *self.releases(dp, server_round))
        if refusal:
            raise BudgetExhausted(refusal)

    def charge(self, dp, clients: list[str], server_round: int) -> None:
        """Charge the round's releases to each client sent a train message."""
        self.ledger.charge(clients, *self.releases(dp, server_round))

    def metrics(self) -> dict[str, float]:
        """The sample-independent bound (published) and the worst client's ε (curator)."""
        return {
            keys.DP_EPSILON_LOCAL: self.ledger.bound(),
            keys.DP_EPSILON_LOCAL_WORST: self.ledger.worst()[1],
        }

    def on_resume(self, dp) -> None:
        """Charge every client one noisy upload (the interrupted round's sample is lost)."""
        self.ledger.charge_all(*self.releases(dp, 0))
        log(INFO, "resume: one noisy upload (and report) charged to every client")

    def summary(self, dp) -> None:
        """The summary's line on the guarantee against the server."""
        log(
            INFO,
            "\t│\t└── against the server: each client's noisy upload, multiplier %.4g, "
            "composed over its own rounds (no amplification)",
            self.upload(dp, 0).noise_multiplier,
        )
