from falcon_jax.train.cli import main

raise SystemExit(main())
