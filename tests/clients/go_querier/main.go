// A client of Pyroscope's query API (querier.v1, Connect protocol) as Grafana's Pyroscope
// data source builds it: the generated Connect client of github.com/grafana/pyroscope/api
// (querierv1connect.NewQuerierServiceClient) over net/http, protobuf by default.
//
// It reads a plan from standard input, {"base": URL, "calls": [...]}, where each call is
// {"rpc": "SelectMergeStacktraces", "request": {...protojson...}, "json": false,
// "gzip": false, "tenant": ""}, makes each call in order and prints one JSON line per
// call: {"rpc": ..., "response": {...protojson...}} or {"rpc": ..., "error": {"code":
// ..., "message": ...}}. "json" uses the Connect JSON codec instead of protobuf, "gzip"
// compresses the request body, "tenant" is sent as X-Scope-OrgID.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"time"

	"connectrpc.com/connect"
	querierv1 "github.com/grafana/pyroscope/api/gen/proto/go/querier/v1"
	"github.com/grafana/pyroscope/api/gen/proto/go/querier/v1/querierv1connect"
	typesv1 "github.com/grafana/pyroscope/api/gen/proto/go/types/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

type call struct {
	RPC     string          `json:"rpc"`
	Request json.RawMessage `json:"request"`
	JSON    bool            `json:"json"`
	Gzip    bool            `json:"gzip"`
	Tenant  string          `json:"tenant"`
}

type plan struct {
	Base  string `json:"base"`
	Calls []call `json:"calls"`
}

// unary calls one RPC with a request decoded from protojson and returns its response.
func unary[Req, Res any](ctx context.Context, c call, req *Req,
	f func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (proto.Message, error) {
	if len(c.Request) > 0 {
		if err := protojson.Unmarshal(c.Request, any(req).(proto.Message)); err != nil {
			return nil, fmt.Errorf("request of %s: %w", c.RPC, err)
		}
	}
	r := connect.NewRequest(req)
	if c.Tenant != "" {
		r.Header().Set("X-Scope-OrgID", c.Tenant)
	}
	res, err := f(ctx, r)
	if err != nil {
		return nil, err
	}
	return any(res.Msg).(proto.Message), nil
}

func do(ctx context.Context, cl querierv1connect.QuerierServiceClient, c call) (proto.Message, error) {
	switch c.RPC {
	case "ProfileTypes":
		return unary(ctx, c, &querierv1.ProfileTypesRequest{}, cl.ProfileTypes)
	case "LabelNames":
		return unary(ctx, c, &typesv1.LabelNamesRequest{}, cl.LabelNames)
	case "LabelValues":
		return unary(ctx, c, &typesv1.LabelValuesRequest{}, cl.LabelValues)
	case "Series":
		return unary(ctx, c, &querierv1.SeriesRequest{}, cl.Series)
	case "SelectMergeStacktraces":
		return unary(ctx, c, &querierv1.SelectMergeStacktracesRequest{}, cl.SelectMergeStacktraces)
	case "SelectMergeSpanProfile":
		return unary(ctx, c, &querierv1.SelectMergeSpanProfileRequest{}, cl.SelectMergeSpanProfile)
	case "SelectSeries":
		return unary(ctx, c, &querierv1.SelectSeriesRequest{}, cl.SelectSeries)
	case "SelectMergeProfile":
		return unary(ctx, c, &querierv1.SelectMergeProfileRequest{}, cl.SelectMergeProfile)
	case "SelectHeatmap":
		return unary(ctx, c, &querierv1.SelectHeatmapRequest{}, cl.SelectHeatmap)
	case "Diff":
		return unary(ctx, c, &querierv1.DiffRequest{}, cl.Diff)
	case "GetProfileStats":
		return unary(ctx, c, &typesv1.GetProfileStatsRequest{}, cl.GetProfileStats)
	}
	return nil, fmt.Errorf("unknown rpc %q", c.RPC)
}

func main() {
	var p plan
	if err := json.NewDecoder(os.Stdin).Decode(&p); err != nil {
		fmt.Fprintln(os.Stderr, "plan:", err)
		os.Exit(2)
	}
	httpClient := &http.Client{Timeout: 60 * time.Second}
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for _, c := range p.Calls {
		var opts []connect.ClientOption
		if c.JSON {
			opts = append(opts, connect.WithProtoJSON())
		}
		if c.Gzip {
			opts = append(opts, connect.WithSendGzip())
		}
		cl := querierv1connect.NewQuerierServiceClient(httpClient, p.Base, opts...)
		line := map[string]any{"rpc": c.RPC}
		msg, err := do(context.Background(), cl, c)
		var cerr *connect.Error
		switch {
		case errors.As(err, &cerr):
			line["error"] = map[string]string{"code": cerr.Code().String(), "message": cerr.Message()}
		case err != nil:
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		default:
			// every field, zeros included: the test compares whole answers
			raw, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(msg)
			if err != nil {
				fmt.Fprintln(os.Stderr, "response:", err)
				os.Exit(1)
			}
			line["response"] = json.RawMessage(raw)
		}
		b, _ := json.Marshal(line)
		out.Write(b)
		out.WriteByte('\n')
	}
}
