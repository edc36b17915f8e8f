"""Analysis of runs and simulations: ``load`` (run dirs, sweeps and simulator outputs into pandas),
``labels`` (readable names), ``figures`` (the paper's simulator figures), ``comparison`` and
``run_figures`` (real runs compared), ``validation`` (simulator vs real), ``dashboards`` (wandb
workspaces), ``paper_figures`` (regenerate the figures from saved runs) and ``notebooks``."""
