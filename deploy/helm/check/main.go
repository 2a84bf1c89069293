// Command check decodes Kubernetes manifests (a multi-document YAML stream on stdin, as `helm
// template` prints it) strictly into the API's own Go types: client-go's scheme for the built-in
// kinds and prometheus-operator's for ServiceMonitor and PrometheusRule. An unknown field, a
// wrong type or an unknown kind is an error (exit status 1); on success it prints one line per
// object, "apiVersion kind name". Kinds named as arguments are only parsed (for custom resources
// whose Go types are not available here); they print "unchecked" after the name.
//
//	helm template kvgate deploy/helm/kvgate | go run ./deploy/helm/check [KIND...]
package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	sigyaml "sigs.k8s.io/yaml"
)

func main() {
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		fail(err)
	}
	if err := monitoringv1.AddToScheme(s); err != nil {
		fail(err)
	}
	strict := json.NewSerializerWithOptions(json.DefaultMetaFactory, s, s,
		json.SerializerOptions{Yaml: false, Strict: true})
	skip := map[string]bool{}
	for _, kind := range os.Args[1:] {
		skip[kind] = true
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(os.Stdin))
	count := 0
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			fail(err)
		}
		raw, err := sigyaml.YAMLToJSON(doc)
		if err != nil {
			fail(err)
		}
		if string(raw) == "null" {
			continue // an empty document (a template that rendered nothing)
		}
		var u unstructured.Unstructured
		if err := u.UnmarshalJSON(raw); err != nil {
			fail(err)
		}
		if skip[u.GetKind()] {
			fmt.Printf("%s %s %s unchecked\n", u.GetAPIVersion(), u.GetKind(), u.GetName())
			count++
			continue
		}
		if _, _, err := strict.Decode(raw, nil, nil); err != nil {
			fail(fmt.Errorf("%s %s %q: %w", u.GetAPIVersion(), u.GetKind(), u.GetName(), err))
		}
		fmt.Printf("%s %s %s\n", u.GetAPIVersion(), u.GetKind(), u.GetName())
		count++
	}
	if count == 0 {
		fail(errors.New("no objects"))
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
