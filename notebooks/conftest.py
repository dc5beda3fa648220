"""nbval runs the lessons with the reference answers: each exercise's check cell passes the
learner's function through ``fa_lab.lab.exercises.yours``, which returns the answer from
``fa_lab.lab.solutions`` under ``FA_LAB_SOLUTIONS=1``. The kernels nbval starts inherit this
process's environment, so setting it here, before any kernel starts, covers every lesson."""

import os

os.environ["FA_LAB_SOLUTIONS"] = "1"
