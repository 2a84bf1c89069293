// Command check loads a Compose file with compose-go, the library `docker compose` itself
// uses: the file is validated against the Compose specification's schema, interpolated and
// normalized exactly as `docker compose config` would. It prints the normalized project as
// JSON (kvgate's tests assert on it) or the loader's error, with exit status 1.
//
//	go run ./deploy/compose/check deploy/compose/compose.yaml
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: check COMPOSE_FILE")
		os.Exit(2)
	}
	opts, err := cli.NewProjectOptions(
		[]string{os.Args[1]},
		cli.WithName("kvgate"),
		cli.WithResolvedPaths(true),
		cli.WithNormalization(true),
		cli.WithConsistency(true),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	out, err := project.MarshalJSON()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}
