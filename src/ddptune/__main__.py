from ddptune.cli import main

raise SystemExit(main())
