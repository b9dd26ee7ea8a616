"""The online SLO controller: it watches steps and requests, fits a step-time model, predicts
which batch limits meet the p99 TTFT/TPOT targets, and sets the scheduler's limits through
``Scheduler.set_limits``. Nothing else of the scheduler is touched."""
