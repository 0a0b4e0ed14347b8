"""Sentence-splitter data for NVIDIA's packaged RULER, made offline (run by the RULER venv's
Python, not the project's: ``python ruler_punkt.py NLTK_DATA_DIR``).

RULER's essay haystacks (``niah.py``) split text with ``nltk.sent_tokenize``, whose
``punkt_tab`` model is a download this machine cannot make. NLTK's own Punkt trainer
(unsupervised: abbreviations, collocations and sentence starters learned from raw text)
is run on the package's essays instead, and its parameters written in the ``punkt_tab``
layout under ``NLTK_DATA_DIR/tokenizers/punkt_tab/english/``; ``sent_tokenize`` then
loads them as it would the downloaded model. The split differs from upstream's only where
the two models disagree on an abbreviation (the needles are inserted between sentences,
so a depth may land a sentence earlier or later; the task is the same).
"""

from __future__ import annotations

import json
import os
import sys


def main(target: str) -> None:
    import long_context_eval
    from nltk.tabdata import TabEncoder
    from nltk.tokenize.punkt import PunktTrainer

    essays = os.path.join(os.path.dirname(long_context_eval.__file__), "data/synthetic/json/PaulGrahamEssays.json")
    with open(essays, encoding="utf-8") as handle:
        text = json.load(handle)["text"]
    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    params = trainer.get_params()
    folder = os.path.join(target, "tokenizers", "punkt_tab", "english")
    os.makedirs(folder, exist_ok=True)
    encoder = TabEncoder()
    files = {
        "collocations.tab": encoder.tups2tab(params.collocations),
        "sent_starters.txt": encoder.set2txt(params.sent_starters),
        "abbrev_types.txt": encoder.set2txt(params.abbrev_types),
        "ortho_context.tab": encoder.ivdict2tab(params.ortho_context),
    }
    for name, body in files.items():  # plain writes: nltk's own saver refuses paths outside its sandbox
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as handle:
            handle.write(body)
    print(f"punkt_tab: {len(params.abbrev_types)} abbreviations, {len(params.sent_starters)} sentence starters")


if __name__ == "__main__":
    main(sys.argv[1])
