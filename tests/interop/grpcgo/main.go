// Command grpcgo drives kvgate's endpoint picker with gRPC's Go implementation (grpc-go's own
// HTTP/2 transport, HPACK and flow control): the interop test of router/h2.py against a client
// kvgate did not write (tests/edge/test_grpcgo_interop.py).
//
// It reads a JSON plan on stdin: the gateway key, and streams, each a list of ext_proc
// ProcessingRequest messages (serialized, base64). All streams are opened at once on one
// connection, as Envoy multiplexes its ext_proc streams; each sends its messages in order,
// half-closes, and reads every answer until the status. With -health it checks a service of
// gRPC's health protocol instead. The result, JSON on stdout: per stream the answers (base64),
// the status code and message.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// raw passes messages as the bytes they are: the test builds them from Envoy's protos.
type raw struct{}

func (raw) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (raw) Name() string { return "raw" }

type plan struct {
	Key     string     `json:"key"`
	Streams [][][]byte `json:"streams"`
}

type result struct {
	Answers [][]byte `json:"answers"`
	Code    int      `json:"code"`
	Message string   `json:"message"`
}

const process = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

func stream(ctx context.Context, conn *grpc.ClientConn, key string, messages [][]byte) result {
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-kvgate-gateway-key", key)
	}
	desc := &grpc.StreamDesc{StreamName: "Process", ServerStreams: true, ClientStreams: true}
	s, err := conn.NewStream(ctx, desc, process, grpc.ForceCodec(raw{}))
	if err != nil {
		st := status.Convert(err)
		return result{Code: int(st.Code()), Message: st.Message()}
	}
	for _, m := range messages {
		msg := m
		if err := s.SendMsg(&msg); err != nil {
			break // the status comes with RecvMsg
		}
	}
	_ = s.CloseSend()
	out := result{Answers: [][]byte{}}
	for {
		var answer []byte
		err := s.RecvMsg(&answer)
		if err == io.EOF {
			return out
		}
		if err != nil {
			st := status.Convert(err)
			out.Code, out.Message = int(st.Code()), st.Message()
			return out
		}
		out.Answers = append(out.Answers, answer)
	}
}

func main() {
	addr := flag.String("addr", "", "host:port of the picker")
	health := flag.String("health", "", "check this health service instead")
	flag.Parse()
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	enc := json.NewEncoder(os.Stdout)
	if *health != "" {
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: *health})
		if err != nil {
			st := status.Convert(err)
			_ = enc.Encode(map[string]any{"code": int(st.Code()), "message": st.Message()})
			return
		}
		_ = enc.Encode(map[string]any{"code": 0, "status": resp.GetStatus().String()})
		return
	}
	var p plan
	if err := json.NewDecoder(os.Stdin).Decode(&p); err != nil {
		fmt.Fprintln(os.Stderr, "the plan:", err)
		os.Exit(2)
	}
	results := make([]result, len(p.Streams))
	var wg sync.WaitGroup
	for i, messages := range p.Streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = stream(ctx, conn, p.Key, messages)
		}()
	}
	wg.Wait()
	_ = enc.Encode(map[string]any{"streams": results})
}

var _ encoding.Codec = raw{}
