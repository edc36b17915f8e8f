"""Analysis of runs and simulations: ``load`` (run dirs and simulator outputs into pandas),
``figures`` (the paper's figures with seaborn) and ``paper_figures`` (regenerate them from saved runs)."""
