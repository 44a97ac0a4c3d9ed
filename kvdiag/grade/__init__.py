"""``kvdiag grade``: a rule graded on a fixed, versioned benchmark (``benchmark``: the shipped inputs and their
seal; ``run``: grading and the leaderboard)."""
