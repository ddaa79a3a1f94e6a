"""Real tables that installed packages ship (no download): scikit-learn's and statsmodels' bundled data sets.

`load_table(name)` returns a `Table` (a DataFrame, the name of its outcome column and one line saying what it is);
`TABLES` lists the names. Only loaders that read files inside the installed package are used: scikit-learn's
`load_diabetes` / `load_breast_cancer` / `load_wine` and statsmodels' `sm.datasets.<name>.load_pandas()` — never
`get_rdataset`, which downloads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Table:
    name: str
    frame: pd.DataFrame
    outcome: str  # the column the hypotheses are about
    description: str

    @property
    def features(self) -> list[str]:
        return [c for c in self.frame.columns if c != self.outcome]

    def __stage_key__(self):
        return (self.name, self.outcome, self.frame.to_numpy(), list(self.frame.columns))


def _sklearn(loader, outcome: str) -> pd.DataFrame:
    bunch = loader(as_frame=True)
    frame = bunch.frame.rename(columns={"target": outcome})
    frame.columns = [str(c).replace(" ", "_") for c in frame.columns]
    return frame


def _statsmodels(name: str, columns: list[str]) -> pd.DataFrame:
    import statsmodels.api as sm

    return getattr(sm.datasets, name).load_pandas().data[columns].astype(float)


_SOURCES = {
    "diabetes": (lambda: _sklearn(__import__("sklearn.datasets").datasets.load_diabetes, "progression"),
                 "progression", "scikit-learn load_diabetes: 442 patients, 10 baseline variables, disease "
                                "progression after one year"),
    "breast_cancer": (lambda: _sklearn(__import__("sklearn.datasets").datasets.load_breast_cancer, "benign"),
                      "benign", "scikit-learn load_breast_cancer: 569 tumours, 30 cell-nucleus measurements, "
                                "benign (1) or malignant (0)"),
    "wine": (lambda: _sklearn(__import__("sklearn.datasets").datasets.load_wine, "cultivar"),
             "cultivar", "scikit-learn load_wine: 178 wines, 13 chemical measurements, cultivar 0/1/2"),
    "fair": (lambda: _statsmodels("fair", ["rate_marriage", "age", "yrs_married", "children", "religious", "educ",
                                           "occupation", "occupation_husb", "affairs"]),
             "affairs", "statsmodels fair: 6,366 women (Redbook 1974 survey), time spent in affairs"),
    "anes96": (lambda: _statsmodels("anes96", ["popul", "TVnews", "selfLR", "ClinLR", "DoleLR", "PID", "age",
                                               "educ", "income", "vote"]),
               "vote", "statsmodels anes96: 944 voters of the 1996 US election, vote Clinton (0) / Dole (1)"),
}
TABLES = tuple(_SOURCES)


@functools.cache
def _frame(name: str) -> pd.DataFrame:
    return _SOURCES[name][0]()


def load_table(name: str) -> Table:
    """One bundled table by name (`TABLES`); an unknown name is a ValueError naming the known ones."""
    if name not in _SOURCES:
        raise ValueError(f"table {name!r} is not bundled here; use one of {', '.join(TABLES)}.")
    _, outcome, text = _SOURCES[name]
    return Table(name, _frame(name).copy(), outcome, text)
