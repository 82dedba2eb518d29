"""Writes the mixle models the differential tests read, as ``model.to_dict()`` JSON.

Run with mixle 0.8.2 installed (``pip install -e '.[mixle]'``) from the repository root:

    python tests/mixle_models/make_models.py

The same builders are imported by tests/test_mixle_models.py, which compares our reading of the
committed JSON with the live models where mixle is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent


def build_models() -> dict:
    """name -> a mixle model, built with mixle's public constructors (mixle.stats)."""
    import mixle.stats as S
    import numpy as np

    rng = np.random.default_rng(23)
    models = {}
    models["diag_mixture"] = S.MixtureDistribution(
        [S.DiagonalGaussianDistribution(rng.normal(0, 3, 3), rng.uniform(0.5, 2.0, 3)) for _ in range(6)],
        rng.dirichlet(np.ones(6)),
    )
    full = []
    for _ in range(4):
        a = np.eye(3) + 0.3 * rng.normal(size=(3, 3))
        full.append(S.MultivariateGaussianDistribution(rng.normal(0, 3, 3), a @ a.T))
    models["full_mixture"] = S.MixtureDistribution(full, rng.dirichlet(np.ones(4)))
    models["composite"] = S.CompositeDistribution(
        [
            S.GaussianDistribution(1.5, 2.0),
            S.IntegerCategoricalDistribution(0, rng.dirichlet(np.ones(5))),
            S.PoissonDistribution(3.5),
            S.ExponentialDistribution(0.8),
        ]
    )
    # A heavy mixture inside a thin composite: the axis to cut is the nested mixture.
    models["nested"] = S.CompositeDistribution(
        [
            S.GaussianDistribution(0.0, 1.0),
            S.MixtureDistribution(
                [S.DiagonalGaussianDistribution(rng.normal(0, 3, 8), rng.uniform(0.5, 2.0, 8)) for _ in range(12)],
                rng.dirichlet(np.ones(12)),
            ),
        ]
    )
    models["categorical_mixture"] = S.MixtureDistribution(
        [
            S.CompositeDistribution(
                [
                    S.CategoricalDistribution({i: float(p) for i, p in enumerate(rng.dirichlet(np.ones(4)))}),
                    S.PoissonDistribution(float(rng.uniform(1, 8))),
                ]
            )
            for _ in range(3)
        ],
        rng.dirichlet(np.ones(3)),
    )
    t = rng.dirichlet(np.ones(3), size=3) + 3 * np.eye(3)
    models["hmm"] = S.HiddenMarkovModelDistribution(
        [S.GaussianDistribution(float(m), 1.0) for m in (-3.0, 0.0, 3.0)],
        [0.5, 0.3, 0.2],
        t / t.sum(axis=1, keepdims=True),
    )
    models["hmm_length"] = S.HiddenMarkovModelDistribution(
        [S.DiagonalGaussianDistribution(rng.normal(0, 2, 2), [1.0, 1.0]) for _ in range(2)],
        [0.6, 0.4],
        [[0.9, 0.1], [0.2, 0.8]],
        len_dist=S.PoissonDistribution(12.0),
    )
    models["sequence"] = S.SequenceDistribution(
        S.IntegerCategoricalDistribution(0, [0.1, 0.2, 0.7]), S.PoissonDistribution(5.0)
    )
    shared = S.DiagonalGaussianDistribution([0.0, 0.0], [4.0, 4.0], name="background")
    models["shared_component"] = S.CompositeDistribution(
        [
            S.MixtureDistribution([shared, S.DiagonalGaussianDistribution([3.0, 3.0], [1.0, 1.0])], [0.5, 0.5]),
            S.MixtureDistribution([shared, S.DiagonalGaussianDistribution([-3.0, 3.0], [1.0, 1.0])], [0.7, 0.3]),
        ]
    )
    models["big_mixture"] = S.MixtureDistribution(
        [
            S.DiagonalGaussianDistribution(rng.normal(0, 3, 4 + (k % 5)), rng.uniform(0.5, 2.0, 4 + (k % 5)))
            for k in range(40)
        ],
        rng.dirichlet(np.ones(40)),
    )
    # Sequences of two kinds, short ones often empty: the posterior weights fit each kind's length.
    models["sequence_mixture"] = S.MixtureDistribution(
        [
            S.SequenceDistribution(S.IntegerCategoricalDistribution(0, [0.6, 0.3, 0.1]), S.PoissonDistribution(1.5)),
            S.SequenceDistribution(S.IntegerCategoricalDistribution(0, [0.1, 0.2, 0.7]), S.PoissonDistribution(7.0)),
        ],
        [0.4, 0.6],
    )
    return models


def build_refused() -> dict:
    """Models the distribution spec cannot express, each refused by class and place."""
    import mixle.stats as S

    return {
        "refused_gamma": S.MixtureDistribution(
            [S.GaussianDistribution(0.0, 1.0), S.GammaDistribution(2.0, 1.5)], [0.5, 0.5]
        ),
    }


def main() -> None:
    for name, model in {**build_models(), **build_refused()}.items():
        (HERE / f"{name}.json").write_text(json.dumps(model.to_dict(), indent=1, sort_keys=False) + "\n")
        print("wrote", name)


if __name__ == "__main__":
    main()
