"""``python -m pipeline_recipes.recipe.worker <job.yaml>``: one training process (:mod:`.entry`)."""

import sys

from pipeline_recipes.recipe.worker.entry import main

sys.exit(main(sys.argv[1:]))
